"""The real connector (both roles, vLLM's own base class, real tensors, real writer and files)
driven through the hook order of each vLLM model runner, as read in vLLM's source
(``connector/contract/vllm_hooks.py``; ``make vllm-conformance`` holds that data to the 0.32,
0.33 and 0.34 wheels): V1 (≤ 0.33, ``get_finished`` before the draft model, ``wait_for_save``
after), V2 of 0.32 (all of ``post_forward`` after it) and V2 of 0.33/0.34 (``post_forward
(defer_finalize=True)`` before it, ``finalize_step`` after), each with its ``no_forward`` steps.

A small engine stands in for vLLM around the hooks: a block pool that frees a request's blocks
only when the worker reports it in ``finished_sending`` (and then hands them to the next
request), the extraction model writing each step's hidden states into the cache where the
runner runs the draft model (``PROPOSE``), and the scheduler-side metadata pickled to the worker.
Every request's file must hold exactly its own states, and every request's blocks come back.

A connector that assumed ``wait_for_save`` runs before ``get_finished`` (the natural place to
start saves, vLLM's Example connector's) is shown to lose requests under V1's and V2's deferred
orders; one that does not re-take the cache on sleep mode's wake-up, to write stale states.
"""

from __future__ import annotations

import fcntl
import pickle
import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
plugin = pytest.importorskip("connector.vllm_plugin")  # vLLM's base class: the test's other half

from safetensors.torch import load_file  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from connector.contract import spool as SP  # noqa: E402
from connector.contract import vllm_hooks as H  # noqa: E402

LAYERS = [2, 6, 9]  # ascending: vLLM stores them so
N_LAYERS, HIDDEN, BS, NBLOCKS = 12, 8, 4, 20
CACHE_LAYER = "model.extract_hidden_states.attn"


def vllm_config(spool) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"shared_storage_path": str(spool), "notice_endpoint": "none",
                                       "num_writer_threads": 2},  # fmt: skip
            is_kv_producer=True,
        ),
        speculative_config=SimpleNamespace(
            method="extract_hidden_states",
            draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=LAYERS)),
        ),
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: N_LAYERS, get_hidden_size=lambda: HIDDEN,
                                     dtype="torch.bfloat16", served_model_name="m", model="m"),  # fmt: skip
        cache_config=SimpleNamespace(block_size=BS),
    )


class Engine:
    """vLLM's scheduler and runner loop, reduced to what the connector sees (one-step prefills)."""

    def __init__(self, runner: H.Runner, worker_cls, spool, monkeypatch, seed: int = 0) -> None:
        import vllm.config
        import vllm.distributed.parallel_state as ps

        monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config", lambda cfg, cls, names: {n: None for n in names})
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
        cfg = vllm_config(spool)
        self.runner = runner
        self.spool = spool
        self.sched = plugin.HiddenStatesStreamConnector(cfg, KVConnectorRole.SCHEDULER, None)
        self.worker = worker_cls(cfg, KVConnectorRole.WORKER, None)
        phys = torch.zeros((NBLOCKS, BS, len(LAYERS), HIDDEN), dtype=torch.bfloat16)  # token-major memory
        self.kv_caches = {CACHE_LAYER: phys.permute(0, 2, 1, 3)}  # vLLM 0.30+'s logical view of it
        self.worker.register_kv_caches(self.kv_caches)
        self.free = list(range(NBLOCKS))
        self.rng = random.Random(seed)
        self.waiting: list[SimpleNamespace] = []
        self.held: dict[str, list[int]] = {}  # finished, blocks kept for the connector (delay-free)
        self.finished_for_worker: set[str] = set()
        self.states: dict[str, torch.Tensor] = {}
        self.token_ids: dict[str, list[int]] = {}
        self.finished_at: dict[str, int] = {}
        self.released_at: dict[str, int] = {}
        self.hooks_seen: list[list[str]] = []
        self.n = 0

    def submit(self, count: int) -> None:
        for _ in range(count):
            rid = f"req-{self.n}"
            self.n += 1
            t = self.rng.randint(3, 18)
            self.token_ids[rid] = [self.rng.randrange(1000) for _ in range(t)]
            self.states[rid] = torch.randn((t, len(LAYERS), HIDDEN)).to(torch.bfloat16)
            self.waiting.append(SimpleNamespace(request_id=rid, kv_transfer_params=None, prompt_token_ids=self.token_ids[rid],
                                                all_token_ids=self.token_ids[rid] + [7], num_computed_tokens=t,
                                                status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED")))  # fmt: skip

    def step(self, index: int) -> None:
        scheduled = []  # (request, its blocks)
        while self.waiting and len(self.free) >= -(-len(self.waiting[0].prompt_token_ids) // BS):
            req = self.waiting.pop(0)
            blocks = [self.free.pop(0) for _ in range(-(-len(req.prompt_token_ids) // BS))]
            self.sched.update_state_after_alloc(req, SimpleNamespace(), 0)
            scheduled.append((req, blocks))
        meta = pickle.loads(pickle.dumps(self.sched.build_connector_meta(None)))  # EngineCore → worker
        finished, self.finished_for_worker = self.finished_for_worker, set()
        hooks = H.step(self.runner, "forward" if scheduled else "no_forward")
        self.hooks_seen.append(hooks)
        sending: set[str] = set()
        for h in hooks:
            if h == H.PROPOSE:  # vLLM's extraction model writes this step's states into its cache
                kv = self.kv_caches[CACHE_LAYER]
                for req, blocks in scheduled:
                    for t, row in enumerate(self.states[req.request_id]):
                        kv[blocks[t // BS], :, t % BS] = row
            elif h == H.BODY:
                pass
            elif h in ("handle_preemptions", "bind_connector_metadata"):
                getattr(self.worker, h)(meta)
            elif h == "start_load_kv":
                self.worker.start_load_kv(None)
            elif h == "get_transfer_results":
                sending = set(self.worker.get_transfer_results(finished).finished_sending or ())
            else:
                getattr(self.worker, h)()
        for rid in sending:  # the scheduler frees what the worker reported (KVOutputAggregator, count 1)
            self.free += self.held.pop(rid)
            self.released_at[rid] = index
        for req, blocks in scheduled:  # one token sampled: each finishes this step
            delay, _ = self.sched.request_finished(req, blocks)
            self.finished_at[req.request_id] = index
            if delay:
                self.held[req.request_id] = blocks
                self.finished_for_worker.add(req.request_id)
            else:
                self.free += blocks

    def run(self, requests: int = 14, steps: int = 30, first: int = 0) -> None:
        for i in range(first, first + steps):
            if requests > 0:  # arrivals every step: the next step of a finished request runs the model
                k = min(requests, self.rng.randint(1, 2))
                self.submit(k)
                requests -= k
            self.step(i)

    def close(self) -> None:
        self.worker.shutdown()

    def problems(self) -> list[str]:
        """What went wrong, as the test reports it (empty: every request saved and released)."""
        out = []
        for rid, at in self.finished_at.items():
            if rid not in self.released_at:
                out.append(f"{rid}: its blocks were never released (finished at step {at})")
                continue
            path = self.spool / SP.file_name_for_request(rid)
            if not path.exists():
                out.append(f"{rid}: no file")
                continue
            f = load_file(str(path))
            if f["token_ids"].tolist() != self.token_ids[rid]:
                out.append(f"{rid}: wrong token ids")
            elif not torch.equal(f["hidden_states"], self.states[rid]):
                out.append(f"{rid}: the file does not hold the request's hidden states")
        return out


class SavesInWaitForSave(plugin.HiddenStatesStreamConnector):
    """Planted order dependency: starts the step's saves in wait_for_save (as vLLM's Example
    connector does) and only reports in get_finished, assuming wait_for_save came first."""

    def wait_for_save(self) -> None:
        bound, self._bound = self._bound, []
        pending = [p for m in bound for p in m.pending]
        locks = {k: v for m in bound for k, v in m.new_locks.items()}
        self._worker.step(pending, set(), locks)

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
        return self._worker.step([], finished_req_ids, {}), None


class KeepsTheCacheView(plugin.HiddenStatesStreamConnector):
    """Planted sleep-mode bug: keeps reading through the view taken before the sleep."""

    def restore_kv_caches(self) -> None:
        self._worker._cache_released = False


@pytest.mark.parametrize("runner", H.RUNNERS, ids=lambda r: r.name)
def test_every_request_is_saved_and_released_in_each_runners_order(runner, spool, monkeypatch):
    e = Engine(runner, plugin.HiddenStatesStreamConnector, spool, monkeypatch)
    try:
        e.run()
    finally:
        e.close()
    assert not e.waiting and len(e.finished_at) == 14
    assert {tuple(h) for h in e.hooks_seen} == {tuple(H.step(runner, p)) for p in ("forward", "no_forward")}
    assert e.problems() == []
    # on CPU the copy is made in get_finished: the blocks come back the step after the request finished
    assert all(e.released_at[r] == e.finished_at[r] + 1 for r in e.finished_at)
    assert sorted(e.free) == list(range(NBLOCKS))
    for lock in spool.glob("*.lock"):  # each plain client's lock was let go (the file is complete)
        with open(lock) as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("runner", H.RUNNERS, ids=lambda r: r.name)
def test_a_connector_assuming_wait_for_save_runs_first_loses_requests_where_it_does_not(runner, spool, monkeypatch):
    e = Engine(runner, SavesInWaitForSave, spool, monkeypatch)
    try:
        e.run()
    finally:
        e.close()
    waits_first = H.step(runner, "forward").index("wait_for_save") < H.step(runner, "forward").index("get_transfer_results")
    if waits_first:  # V2 of 0.32: its post_forward runs wait_for_save first
        assert e.problems() == []
    else:  # V1 and V2 of 0.33/0.34 with a draft model: get_finished first, the ids are dropped
        assert any("never released" in p for p in e.problems()), e.problems()


def test_saves_are_taken_when_the_metadata_is_bound_not_when_get_finished_runs(spool, monkeypatch):
    """No vLLM runner clears the metadata before get_finished today; one that did would lose
    nothing: the step's saves are taken at bind_connector_metadata (synthetic order)."""
    synthetic = H.Runner("synthetic", (), H.V2.fns, H.V2.links, H.V2.propose, H.V2.paths)
    e = Engine(synthetic, plugin.HiddenStatesStreamConnector, spool, monkeypatch)
    real = H.step

    def cleared_first(runner, path):  # noqa: ANN001, ANN202
        hooks = [h for h in real(runner, path) if h != "clear_connector_metadata"]
        return hooks[: hooks.index("get_transfer_results")] + ["clear_connector_metadata"] + \
            hooks[hooks.index("get_transfer_results"):]  # fmt: skip

    monkeypatch.setattr(H, "step", cleared_first)
    try:
        e.run()
    finally:
        e.close()
    assert e.problems() == []


def _sleep_and_wake(e: Engine, at: int, pending_while_asleep: bool) -> None:
    e.run(requests=6, steps=10, first=at)
    e.worker.unregister_kv_caches()  # vLLM: the scheduler is paused, transfers drained
    if pending_while_asleep:  # a save that reaches the worker while the cache is released
        e.submit(1)
        e.step(at + 10)
        e.step(at + 11)
    kv = e.kv_caches[CACHE_LAYER]  # the memory under vLLM's tensor is remapped (new pages, same tensor)
    fresh = torch.zeros(kv.untyped_storage().nbytes() // kv.element_size(), dtype=kv.dtype)
    kv.set_(fresh.untyped_storage(), 0, kv.shape, kv.stride())
    e.worker.restore_kv_caches()


@pytest.mark.parametrize("connector", [plugin.HiddenStatesStreamConnector, KeepsTheCacheView], ids=["ours", "planted"])
def test_sleep_mode_re_takes_the_cache_on_wake_up(connector, spool, monkeypatch):
    e = Engine(H.V2, connector, spool, monkeypatch)
    try:
        _sleep_and_wake(e, 0, pending_while_asleep=True)
        e.run(requests=6, steps=12, first=20)
    finally:
        e.close()
    asleep = "req-6"  # finished while the cache was released: an error notice, no file, blocks back
    assert asleep in e.released_at and not (spool / SP.file_name_for_request(asleep)).exists()
    del e.finished_at[asleep]
    problems = e.problems()
    if connector is plugin.HiddenStatesStreamConnector:
        assert problems == []
    else:
        assert problems and all("does not hold the request's hidden states" in p for p in problems), problems


def test_the_connector_declares_sleep_mode_and_how_it_reaches_the_cache():
    cls = plugin.HiddenStatesStreamConnector
    assert cls.supports_sleep_mode(None) is True
    if plugin.KVCacheAccess is None:  # vLLM < 0.34: no such classmethod to answer
        assert "kv_cache_access" not in cls.__dict__
    else:
        assert cls.kv_cache_access(None) == plugin.KVCacheAccess.IN_PROCESS
