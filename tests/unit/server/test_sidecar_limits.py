"""Limits known only at run time: the engine's max_model_len and the sample size.

The submitter's logic against a fake vLLM (at its HTTP seam) and a real ledger; the same
paths against a real engine are in tests/integration/server/test_engine_limits.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from connector import protocol as P
from connector.contract.rest import JobOptions, SampleIn
from server.ledger import Ledger, NewSample, State
from server.model_shape import SampleSizer, Shape, read_config, shape_from_config
from server.submitter import Submitter
from server.vllm_http import Reply
from tests.unit.server.fake_vllm_http import FakeHttp, Request, reply
from server.tokenization import SampleRefused, Tokenizer
from tests.unit.server.submitter_runs import probe, run_for, started


class FakeVllm:
    def __init__(self, max_model_len: int | None = 512) -> None:
        self.max_model_len = max_model_len
        self.prompts: list[list[int]] = []

    def __call__(self, request: Request) -> Reply:
        if request.path == "/v1/models":
            card = {"id": "m"} | ({"max_model_len": self.max_model_len} if self.max_model_len else {})
            return reply(200, {"data": [card]})
        self.prompts.append(request.body["prompt"])
        return reply(200, {"choices": [{"text": "x"}]})


def submitter(ledger, fake, **kw):
    return Submitter(ledger, "http://vllm", client=FakeHttp(fake), notice_timeout_s=600, **kw)


def test_samples_queued_before_the_engine_limit_fail_at_once_without_an_attempt():
    led = Ledger()
    job = led.add_job([NewSample([7] * 511, None, "fits", 100), NewSample([7] * 600, None, "long", 100),
                       NewSample([7] * 512, None, "one-over", 100)])  # fmt: skip
    fake = FakeVllm(512)
    sub = submitter(led, fake, budget_bytes=150)  # one at a time: the others are failed while still queued
    asyncio.run(run_for(sub, 0.5))
    st = {s.label: s for s in led.job_samples(job.job_id)}
    assert [len(p) for p in fake.prompts] == [511]  # only the one that fits reached vLLM
    assert st["fits"].state == State.submitted
    for label, n in (("long", 600), ("one-over", 512)):
        s = st[label]
        assert s.state == State.failed and s.attempt == 0 and len(s.errors) == 1
        assert s.errors[0] == (f"sample has {n} tokens, more than vLLM's max_model_len of 512 allows "
                               "(511 prompt tokens + 1 generated)")  # fmt: skip
    assert sub.engine_max_len == 512 and sub.stats["failed_over_engine_limit"] == 2


def test_engine_limit_reaches_admission():
    tok = Tokenizer(None, max_model_len=2048)
    opt = JobOptions()
    tok(SampleIn(token_ids=[1] * 1890), opt)  # fits the config's limit
    led = Ledger()
    sub = submitter(led, FakeVllm(512), budget_bytes=10**9, on_engine_limit=tok.set_engine_limit)

    assert asyncio.run(probe(sub)) == 512
    with pytest.raises(SampleRefused, match=r"1890 tokens, more than vLLM's max_model_len of 512"):
        tok(SampleIn(token_ids=[1] * 1890), opt)


def notice_for(s, shape=(4, 128, "bfloat16")):
    layers, hidden, dtype = shape
    return P.Notice(status=P.NoticeStatus.ok, request_id=f"r{s.key.index}", key=s.key, attempt=s.attempt,
                    file=f"f{s.key.index}.safetensors", num_tokens=len(s.token_ids), layer_ids=list(range(layers)),
                    hidden_size=hidden, dtype=dtype, nbytes=len(s.token_ids) * layers * hidden * 2)  # fmt: skip


def test_unknown_size_one_in_flight_until_the_first_notice_then_by_the_learned_size():
    led = Ledger()
    job = led.add_job([NewSample([3] * 100, None, f"s{i}", 0) for i in range(8)])
    sizer = SampleSizer(None)
    per_sample = Shape(4, 128, 2, "notice").file_bytes(100)
    budget = 3 * per_sample + 10  # room for three samples of the learned size
    fake = FakeVllm()
    sub = submitter(led, fake, budget_bytes=budget, sizer=sizer)

    async def scenario():
        async with started(sub):
            await asyncio.sleep(0.5)
            assert len(fake.prompts) == 1 and sub.in_flight == 1  # the rest wait for the size
            first = next(s for s in led.job_samples(job.job_id) if s.state == State.submitted)
            n = notice_for(first)
            assert sizer.learn(n)
            led.on_notice(n, per_sample)
            await asyncio.sleep(0.5)

    asyncio.run(scenario())
    states = [s.state for s in led.job_samples(job.job_id)]
    # first is READY (its file holds per_sample bytes), two more fit beside it, five wait
    assert states.count(State.ready) == 1 and states.count(State.submitted) == 2 and states.count(State.queued) == 5
    assert all(s.expected_bytes == per_sample for s in led.job_samples(job.job_id) if s.state != State.ready)
    assert led.reserved_bytes <= budget
    assert sub.stats["submitted_before_size_known"] == 1 and sub.stats["max_in_flight_before_size_known"] == 1


def test_learned_size_fails_samples_larger_than_the_whole_budget():
    led = Ledger()
    job = led.add_job([NewSample([3] * 10, None, "small", 0), NewSample([3] * 5000, None, "huge", 0)])
    sizer = SampleSizer(None)
    sub = submitter(led, FakeVllm(None), budget_bytes=1_000_000, sizer=sizer)

    async def scenario():
        async with started(sub):
            await asyncio.sleep(0.3)
            first = led.job_samples(job.job_id)[0]
            n = notice_for(first)
            sizer.learn(n)
            led.on_notice(n, 20_000)
            await asyncio.sleep(0.3)

    asyncio.run(scenario())
    huge = led.job_samples(job.job_id)[1]
    assert huge.state == State.failed and "more than the whole spool budget of 1,000,000" in huge.errors[0]
    assert huge.attempt == 0


def test_shape_from_config_uses_the_launchers_layers_without_layer_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 12,
                                                      "torch_dtype": "float32", "max_position_embeddings": 4096}))  # fmt: skip
    sizer, mpe = SampleSizer.for_model(str(tmp_path), [])
    assert sizer.shape.num_layers == 4 and sizer.shape.dtype_size == 4 and mpe == 4096  # [2, 6, 9, 12]
    assert shape_from_config(read_config(str(tmp_path)), [3, 5]).num_layers == 2


@pytest.mark.parametrize("model", ["some-org/some-model", "EMPTY_DIR", ""])
def test_no_readable_config_means_unknown_size(model, tmp_path):
    sizer, mpe = SampleSizer.for_model(str(tmp_path) if model == "EMPTY_DIR" else model, [2, 6, 9, 12])
    assert not sizer.known and sizer.file_bytes(10) is None and mpe is None


def test_a_notice_that_disagrees_with_the_config_wins_once():
    sizer = SampleSizer(Shape(4, 128, 4, "config"))  # the config said float32
    led = Ledger()
    job = led.add_job([NewSample([1] * 10, None, None, 0)])
    s = led.job_samples(job.job_id)[0]
    assert sizer.learn(notice_for(s)) and sizer.shape.dtype_size == 2 and sizer.version == 1
    assert not sizer.learn(notice_for(s, (2, 64, "bfloat16")))  # the first notice decides
    # an arena refusal ("slot too small": the config said bf16, vLLM serves float32) is the only
    # notice such a sample gets: it carries the writer's shape and corrects the price
    err = notice_for(s, (4, 128, "float32")).model_copy(update={"status": P.NoticeStatus.error, "file": None,
                                                                "reason": "slot of 73728 bytes too small"})  # fmt: skip
    small = SampleSizer(Shape(4, 128, 2, "config"))
    assert small.learn(err) and small.shape.dtype_size == 4 and small.version == 1
    assert not SampleSizer(None).learn(err.model_copy(update={"layer_ids": [], "hidden_size": None}))  # no shape: nothing


def test_no_tokenizer_still_takes_token_ids(tmp_path):
    tok = Tokenizer(str(tmp_path))  # a folder without config or tokenizer files
    assert tok(SampleIn(token_ids=[1, 2, 3]), JobOptions()).token_ids == [1, 2, 3]
    with pytest.raises(SampleRefused, match="no tokenizer .*none could be loaded from"):
        tok(SampleIn(prompt="hello"), JobOptions())


def test_a_nearly_full_spool_filesystem_stops_submission_and_a_yes_is_trusted_only_briefly(tmp_path, monkeypatch):
    import server.submitter as sm

    sub = Submitter(Ledger(), "http://vllm", budget_bytes=10**9, spool_dir=str(tmp_path), fs_reserve_bytes=2**62)
    assert not sub._fs_has_room() and not sub._fs_has_room()  # a "no" is asked again each time
    sub.fs_reserve_bytes = 0
    assert sub._fs_has_room()
    sub.fs_reserve_bytes = 2**62  # the filesystem fills up
    monkeypatch.setattr(sm, "FS_CHECK_S", 60.0)
    assert sub._fs_has_room()  # within the window: the last "yes"
    monkeypatch.setattr(sm, "FS_CHECK_S", 0.0)
    assert not sub._fs_has_room()  # past it: asked again
    sub.spool_dir = str(tmp_path / "gone")
    sub.fs_reserve_bytes = 0
    assert not sub._fs_has_room()  # an unreadable spool is no room


def test_a_sample_refused_for_its_price_is_retried_at_the_price_learned_from_the_refusal():
    """The arena on a CPU without bf16 (stop 49's arena bench): the config said bf16, vLLM served
    float32, every slot was half the sample and each retry kept the old price (the ledger saved no
    new price), so every sample failed. The refusal carries the writer's shape: the sizer learns it,
    the retry is priced by it, and the price is what the ledger keeps."""
    led = Ledger()
    job = led.add_job([NewSample([3] * 100, None, f"s{i}", 0) for i in range(2)])
    sizer = SampleSizer(Shape(4, 128, 2, "config"))
    fake = FakeVllm()
    sub = submitter(led, fake, budget_bytes=10 << 20, sizer=sizer)  # wires the ledger's pricer
    sub._apply_limits()  # the queue priced by the config, as the submitter's loop does first
    old, new = Shape(4, 128, 2, "config").file_bytes(100), Shape(4, 128, 4, "notice").file_bytes(100)
    s = led.next_to_submit(10 << 20)
    assert s is not None and s.expected_bytes == old
    err = notice_for(s, (4, 128, "float32")).model_copy(update={"status": P.NoticeStatus.error, "file": None,
                                                                "reason": "slot too small"})  # fmt: skip
    assert sizer.learn(err)
    led.on_notice(err, 0)
    again = led.get(s.key)  # queued: read back from SQLite, not the row in hand
    assert again is not s and again.state == State.queued and again.attempt == 1 and again.expected_bytes == new
    assert led.reserved_bytes == 0  # released at the price it was reserved at


def test_an_arena_slot_priced_too_small_is_sent_again_at_the_right_price_without_using_an_attempt():
    """Not the sample's fault (the sidecar's price was): like a busy connector, no attempt is used,
    and only once, since the next slot is priced by the shape that refusal taught."""
    from server.arena import SlotAllocator

    led = Ledger(max_attempts=1)  # one attempt: a price error must not cost it
    led.attach_slots(SlotAllocator("0123456789abcdef", 16 << 20, quarantine_s=0.0))
    job = led.add_job([NewSample([3] * 100, None, "s0", 0)])
    sizer = SampleSizer(Shape(4, 128, 2, "config"))
    sub = submitter(led, FakeVllm(), budget_bytes=10 << 20, sizer=sizer)
    sub._apply_limits()
    s = led.next_to_submit(10 << 20)
    assert s is not None and s.slot is not None
    err = notice_for(s, (4, 128, "float32")).model_copy(update={
        "status": P.NoticeStatus.error, "file": None, "slot": s.slot, "reason": "slot too small"})  # fmt: skip
    assert sizer.learn(err)
    led.on_notice(err, 0)
    again = led.get(s.key)
    assert again.state == State.queued and again.attempt == 1 and again.errors == []
    assert again.expected_bytes == Shape(4, 128, 4, "notice").file_bytes(100) and led.repriced_refusals == 1
    t = led.next_to_submit(10 << 20)
    assert t.slot.length >= again.expected_bytes  # the new slot holds it
    err2 = err.model_copy(update={"attempt": t.attempt, "slot": t.slot, "reason": "something else"})
    led.on_notice(err2, 0)  # a refusal of a rightly priced slot is the sample's: its one attempt
    assert led.get(t.key).state == State.failed and led.repriced_refusals == 1
