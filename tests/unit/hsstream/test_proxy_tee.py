"""The tee's logic: a finished request and reply as a sample, and every way one is dropped.

The sidecar here is a stand-in recording what it is sent (the real one is in
tests/integration/hsstream/test_proxy_vllm.py); the store is the real SQLite file.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from hsstream.proxy import samples as S
from hsstream.proxy.metrics import ProxyMetrics
from hsstream.proxy.settings import ProxySettings
from hsstream.proxy.store import TeedStore
from hsstream.proxy.tee import Tee, TeeRecord

CHAT_REQ = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
CHAT_REPLY = {"id": "x", "choices": [{"index": 1, "message": {"role": "assistant", "content": "other"}},
                                     {"index": 0, "message": {"role": "assistant", "content": "Hello!"}}]}


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_a_chat_reply_becomes_the_assistant_turn_of_choice_0():
    smp = S.build("chat", json.dumps(CHAT_REQ).encode(), json.dumps(CHAT_REPLY).encode())
    assert smp.row == {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    assert smp.as_row()["id"] == smp.label and smp.label.startswith("traffic-")


def test_a_streamed_chat_reply_is_put_together_from_its_deltas_tool_calls_and_all():
    req = {**CHAT_REQ, "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}],
           "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    body = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 1, "delta": {"content": "NOT choice 0"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
        {"choices": [{"index": 0, "delta": {"content": "check."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                            "function": {"name": "f", "arguments": '{"a"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': 1}'}}]}}]},
        {"choices": [], "usage": {"prompt_tokens": 3}},  # include_usage's last chunk
    )
    smp = S.build("chat", json.dumps(req).encode(), body)
    reply = smp.row["messages"][-1]
    assert reply["content"] == "Let me check."
    assert reply["tool_calls"] == [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert smp.row["tools"] == req["tools"] and json.loads(smp.options_key) == {"enable_thinking": False}


def test_a_completion_is_its_prompt_and_text():
    req = {"model": "m", "prompt": ["The sky is"], "stream": True}
    smp = S.build("completions", json.dumps(req).encode(),
                  sse({"choices": [{"index": 0, "text": " blue"}]}, {"choices": [{"index": 0, "text": "."}]}))
    assert smp.row == {"prompt": "The sky is blue."}


@pytest.mark.parametrize("route,req,reply,why", [
    ("completions", {"prompt": [1, 2, 3]}, {"choices": [{"index": 0, "text": "x"}]}, "token_or_batched_prompt"),
    ("completions", {"prompt": ["a", "b"]}, {"choices": [{"index": 0, "text": "x"}]}, "token_or_batched_prompt"),
    ("completions", {"prompt": "a", "echo": True}, {"choices": [{"index": 0, "text": "ax"}]}, "echo"),
    ("chat", {"messages": []}, CHAT_REPLY, "no_messages"),
    ("chat", CHAT_REQ, {"choices": []}, "no_reply"),
    ("chat", {**CHAT_REQ, "stream": True}, b'data: {"error": {"message": "boom"}}\n\n', "error_in_stream"),
    ("chat", CHAT_REQ, b"not json", "unparsable"),
])  # fmt: skip
def test_what_is_not_taken_says_why(route, req, reply, why):
    with pytest.raises(S.NotTeed, match=why):
        S.build(route, json.dumps(req).encode(), reply if isinstance(reply, bytes) else json.dumps(reply).encode())


def test_the_digest_tells_content_apart_and_only_content():
    a = S.build("chat", json.dumps(CHAT_REQ).encode(), json.dumps(CHAT_REPLY).encode())
    b = S.build("chat", json.dumps({**CHAT_REQ, "max_tokens": 99, "user": "u"}).encode(), json.dumps(CHAT_REPLY).encode())
    assert a.digest == b.digest  # sampling options are not the conversation
    other = {**CHAT_REPLY, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}}]}
    assert S.build("chat", json.dumps(CHAT_REQ).encode(), json.dumps(other).encode()).digest != a.digest


# ---------------------------------------------------------------------------------- the tee thread
class FakeSidecar:
    """Records uploads; ``down`` makes every call fail as an unreachable sidecar does."""

    def __init__(self, queued: int = 0) -> None:
        self.jobs: list[tuple[list[dict], dict]] = []
        self.down = False
        self.queued = queued
        self.closed = False

    def _check(self) -> None:
        from connector.contract.rest_client import SidecarError

        if self.down:
            raise SidecarError("sidecar not reachable", status=None, detail="", method="GET", path="/")

    def overview(self):  # noqa: ANN201
        self._check()
        return type("O", (), {"samples": {"queued": self.queued}})()

    def upload(self, rows, options, filename=""):  # noqa: ANN001, ANN201
        self._check()
        rows = list(rows)
        self.jobs.append((rows, options))
        return type("C", (), {"job_id": f"job{len(self.jobs)}", "num_samples": len(rows), "num_failed_at_submission": 0})()

    def close(self) -> None:
        self.closed = True


def make_tee(tmp_path, fake: FakeSidecar, **kw):  # noqa: ANN001, ANN201
    s = ProxySettings(state_dir=tmp_path / "st", flush_s=0.05, holdout_fraction=0.0, **kw)
    store = TeedStore(s.store_path(), dedup_window=s.dedup_window, holdout_keep=s.holdout_keep, retention_s=s.retention_s)
    m = ProxyMetrics()
    return Tee(s, store, m, client_factory=lambda: fake), m, store


def chat(i: int) -> TeeRecord:
    req = {**CHAT_REQ, "messages": [{"role": "user", "content": f"question {i}"}]}
    return TeeRecord("chat", json.dumps(req).encode(), json.dumps(CHAT_REPLY).encode())


def counts(m: ProxyMetrics) -> dict[str, int]:
    from hsstream.proxy.metrics import TEE_OUTCOMES

    return {o: int(m.tee.labels(o)._value.get()) for o in TEE_OUTCOMES if m.tee.labels(o)._value.get()}


def run_until(tee: Tee, pred, timeout: float = 10.0) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)


def test_samples_go_out_as_jobs_once_each_and_duplicates_are_counted(tmp_path):
    fake = FakeSidecar()
    tee, m, store = make_tee(tmp_path, fake)
    tee.start()
    try:
        for i in (1, 2, 1, 3, 2):
            tee.offer(chat(i))
        run_until(tee, lambda: counts(m).get("teed", 0) == 3)
    finally:
        tee.stop()
    assert counts(m) == {"teed": 3, "duplicate": 2}
    sent = [r for rows, _ in fake.jobs for r in rows]
    assert sorted(r["messages"][0]["content"] for r in sent) == ["question 1", "question 2", "question 3"]
    assert all(o == {"loss_mask": "assistant", "on_invalid": "skip"} for _, o in fake.jobs)
    assert [j["job_id"] for j in store.jobs()] == [f"job{i + 1}" for i in range(len(fake.jobs))]
    assert fake.closed


def test_a_dead_sidecar_drops_the_batch_counts_it_and_the_samples_may_come_again(tmp_path):
    fake = FakeSidecar()
    fake.down = True
    tee, m, _ = make_tee(tmp_path, fake)
    tee.start()
    try:
        tee.offer(chat(1))
        tee.offer(chat(2))
        run_until(tee, lambda: counts(m).get("sidecar_down", 0) == 2)
        fake.down = False
        tee.offer(chat(1))  # not a duplicate: it never reached the sidecar
        run_until(tee, lambda: counts(m).get("teed", 0) == 1)
    finally:
        tee.stop()
    assert counts(m) == {"sidecar_down": 2, "teed": 1}


def test_a_backlog_in_the_sidecar_drops_the_batch(tmp_path):
    tee, m, _ = make_tee(tmp_path, FakeSidecar(queued=50), max_backlog=50)
    tee.start()
    try:
        tee.offer(chat(1))
        run_until(tee, lambda: counts(m).get("backlog", 0) == 1)
    finally:
        tee.stop()


def test_the_per_minute_cap(tmp_path):
    fake = FakeSidecar()
    tee, m, _ = make_tee(tmp_path, fake, max_per_minute=3)
    tee.start()
    try:
        for i in range(5):
            tee.offer(chat(i))
        run_until(tee, lambda: sum(counts(m).values()) == 5)
    finally:
        tee.stop()
    assert counts(m) == {"teed": 3, "capped": 2}


def test_a_full_queue_drops_at_once_and_never_blocks_the_caller(tmp_path):
    fake = FakeSidecar()
    tee, m, _ = make_tee(tmp_path, fake, queue_max=4)  # the thread is not started: nothing drains
    t0 = time.perf_counter()
    for i in range(10):
        tee.offer(chat(i))
    assert time.perf_counter() - t0 < 0.5
    assert counts(m) == {"queue_full": 6}
    tee.start()
    run_until(tee, lambda: counts(m).get("teed", 0) == 4)
    tee.stop()


def test_the_held_out_share_is_kept_apart_and_never_sent(tmp_path):
    fake = FakeSidecar()
    s = ProxySettings(state_dir=tmp_path / "st", flush_s=0.05, holdout_fraction=0.5, holdout_seed=1)
    store = TeedStore(s.store_path(), dedup_window=100, holdout_keep=100, retention_s=3600)
    m = ProxyMetrics()
    tee = Tee(s, store, m, client_factory=lambda: fake)
    tee.start()
    try:
        for i in range(40):
            tee.offer(chat(i))
        run_until(tee, lambda: counts(m).get("teed", 0) + counts(m).get("held_out", 0) == 40)
    finally:
        tee.stop()
    held = store.heldout()
    sent = {r["id"] for rows, _ in fake.jobs for r in rows}
    assert 8 <= len(held) <= 32 and len(held) == counts(m)["held_out"]
    assert not sent & {f"traffic-{h['digest'][:24]}" for h in held}  # disjoint, by content hash
    assert (tmp_path / "st" / "teed.sqlite").stat().st_mode & 0o777 == 0o600


def test_forget_and_the_retention_delete_what_was_stored(tmp_path):
    store = TeedStore(tmp_path / "t.sqlite", dedup_window=3, holdout_keep=2, retention_s=100)
    for i in range(5):
        store.remember(f"d{i}", now=1000 + i)
        store.hold_out(f"h{i}", {"prompt": str(i)}, "", now=1000 + i)
    store.add_job("old", 1, "", now=1000)
    store.add_job("new", 1, "", now=1200)
    assert store.counts() == {"seen": 5, "heldout": 2, "jobs": 2}  # the slice keeps its newest
    gone = store.prune(now=1150)  # past the retention: everything of before 1050
    assert [j["job_id"] for j in gone["expired_jobs"]] == ["old"]
    assert store.counts()["seen"] == 0
    out = store.forget()
    assert [j["job_id"] for j in out["jobs"]] == ["old", "new"]
    assert store.counts() == {"seen": 0, "heldout": 0, "jobs": 0}


def test_offer_is_cheap_beside_a_busy_tee(tmp_path):
    """The loop's side takes a lock shared with the thread only to append; a slow sidecar upload
    never holds it."""
    slow = FakeSidecar()
    gate = threading.Event()
    orig = slow.upload

    def upload(rows, options, filename=""):  # noqa: ANN001, ANN202
        gate.wait(5)
        return orig(rows, options, filename)

    slow.upload = upload  # type: ignore[method-assign]
    tee, m, _ = make_tee(tmp_path, slow)
    tee.start()
    try:
        tee.offer(chat(0))
        time.sleep(0.2)  # the thread is now inside the slow upload
        t0 = time.perf_counter()
        for i in range(1, 200):
            tee.offer(chat(i))
        assert time.perf_counter() - t0 < 0.5
    finally:
        gate.set()
        tee.stop()
