"""Nothing lost, nothing counted twice — with real processes dying.

One engine (vLLM CPU build) and one sidecar for the module, with a small spool budget and a
short trainer timeout so the crash cases resolve in seconds. Trainers are real processes
(tests/integration/trainer_client/trainer_proc.py) that log every key they use and ack.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hsstream import launch
from tests.conftest import SESSION_ENV, prestarted
from tests.integration.conftest import start_stack, stop_stack, submit, tiny, wait_spool_empty
from hsstream.devstack import free_port
from trainer_client import HiddenStateStream, StreamError

BUDGET = 200_000  # bytes: about four of this module's samples at a time
HERE = Path(__file__).resolve().parent


def _reliability_stack(tiny_model, layout: str):
    import tempfile

    state = Path(tempfile.mkdtemp(prefix="hsstream-rel-state-"))
    keys = state / "keys"
    # as `hsstream keys` writes them: the sidecar and the stream refuse a secret others can read
    from connector.contract.curve_keys import write_key_pair

    write_key_pair(keys, "server")
    write_key_pair(keys / "clients", "trainer")
    write_key_pair(keys, "stranger")  # not authorised
    remote_port = free_port()
    st = start_stack(tiny_model, [2, 6, 9, 12], prefix="hsstream-rel-", base_env=SESSION_ENV, env={
        "HSSTREAM_SPOOL_BUDGET_BYTES": str(BUDGET), "HSSTREAM_TRAINER_TIMEOUT_S": "3",
        "HSSTREAM_LEDGER_PATH": str(state / "ledger.sqlite"),
        "HSSTREAM_REMOTE_ENDPOINT": f"tcp://127.0.0.1:{remote_port}",
        "HSSTREAM_CURVE_SERVER_SECRET_FILE": str(keys / "server.key_secret"),
        "HSSTREAM_CURVE_CLIENTS_DIR": str(keys / "clients"),
        # The arena's quarantine of abandoned slots, short so the kill cases resolve in seconds
        # (4 slots fit this budget) while still exercised.
        "HSSTREAM_SPOOL_LAYOUT": layout, "HSSTREAM_ARENA_QUARANTINE_S": "5",
    })  # fmt: skip
    st.remote_port, st.keys, st.layout = remote_port, keys, layout
    return st


#: One stack per spool layout (tests/support/prestart.py starts them ahead).
PRESTART = {layout: (lambda layout=layout: _reliability_stack(tiny(), layout), stop_stack) for layout in ("files", "arena")}


def _module_stack(layout: str):
    st = prestarted(__name__, layout)
    try:
        yield st
    finally:
        stop_stack(st)


@pytest.fixture(scope="module")
def stack():
    yield from _module_stack("files")


@pytest.fixture(scope="module")
def arena_stack():
    yield from _module_stack("arena")


@pytest.fixture(params=["files", "arena"])
def layout_stack(request):
    """The layout-sensitive cases run on both spool layouts (one stack of each for the module)."""
    return request.getfixturevalue("stack" if request.param == "files" else "arena_stack")


def spool_bytes(stack) -> int:
    """Bytes samples hold in the spool: its files, plus the arena's held slots."""
    total = 0
    for name in stack.spool_files():
        try:
            total += (stack.spool / name).stat().st_size
        except FileNotFoundError:
            pass
    if getattr(stack, "layout", "files") == "arena":
        a = httpx.get(f"{stack.api}/v1/stats", timeout=10, headers=stack.headers).json()["arena"]
        total += a["used_bytes"]
    return total


def child(stack, name):
    return next(c for c in stack.children if c.name == name)


def restart(stack, name, wait_url, while_down=None):
    """SIGKILL a child's whole process group, then start it again with the same command
    (``while_down``: what happens in between)."""
    c = child(stack, name)
    os.killpg(c.proc.pid, signal.SIGKILL)
    c.proc.wait(30)
    if while_down is not None:
        while_down()
    new = launch.spawn(name, list(c.proc.args), launch.child_env(stack.env), c.log_path, launch.repo_root())
    stack.children[stack.children.index(c)] = new
    launch.wait_http(wait_url, new, 600)
    return new


def status(stack, job):
    return httpx.get(f"{stack.api}/v1/jobs/{job}", timeout=10, headers=stack.headers).json()


def wait_done(stack, job, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = status(stack, job)
        if st["done"]:
            return st
        time.sleep(0.3)
    raise AssertionError(f"job {job} not done after {timeout} s: {status(stack, job)}")


def token_samples(n, length=40, seed=0):
    import random

    rng = random.Random(seed)
    return [{"token_ids": [rng.randrange(0, 509) for _ in range(length)], "id": f"t{i}"} for i in range(n)]


def start_trainer(stack, log, job, *extra):
    args = [sys.executable, str(HERE.parent / "trainer_client" / "trainer_proc.py"), "--endpoint", stack.delivery_endpoint,
            "--spool", str(stack.spool), "--log", str(log), "--jobs", job, *extra]  # fmt: skip
    return subprocess.Popen(args, env=launch.child_env(), cwd=launch.repo_root(), start_new_session=True)


def read_log(log):
    return [json.loads(ln) for ln in Path(log).read_text().splitlines()] if Path(log).exists() else []


def check_invariant(stack, job, n, acked_lists):
    st = wait_done(stack, job)
    c = st["counts"]
    assert c["consumed"] + c["failed"] + c["cancelled"] == n, c
    assert c["failed"] == 0, st["errors"]
    all_acked = [k for lst in acked_lists for k in lst]
    assert len(all_acked) == len(set(all_acked)), "a sample was acknowledged twice"
    assert len(set(all_acked)) == c["consumed"] == n
    left = wait_spool_empty(stack)  # a killed vLLM's unannounced file is the reaper's (60 s grace)
    assert left == [], spool_leak_report(stack, left)


def spool_leak_report(stack, left):
    """What the next leak needs to be traced: each file's age (written before or after a
    restart?) and the sidecar's log (WARNING+), not only the names."""
    now = time.time()
    ages = []
    for name in left:
        try:
            mtime = (stack.spool / name).stat().st_mtime
            ages.append(f"  {name}: mtime {mtime:.3f} ({now - mtime:.1f} s ago)")
        except FileNotFoundError:
            ages.append(f"  {name}: gone since")
    return (f"files left in the spool at {now:.3f}:\n" + "\n".join(ages)
            + f"\nsidecar log (tail):\n{child(stack, 'sidecar').tail(80)}")


def test_chat_job_token_ids_and_loss_mask(stack, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Grüß dich! 2+2?"},
        {"role": "assistant", "content": "4 ✓"},
        {"role": "user", "content": "and ½ + ½?"},
        {"role": "assistant", "content": "1, naturellement 🙂"},
    ]
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    S, E = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask = [], []

    def part(t, m):
        ids.extend(t)
        mask.extend([m] * len(t))

    # Spelled out: only each assistant reply and its closing <|im_end|> are trained on.
    part([S] + enc("system\nYou are terse.") + [E] + enc("\n"), 0)
    part([S] + enc("user\nGrüß dich! 2+2?") + [E] + enc("\n"), 0)
    part([S] + enc("assistant\n"), 0)
    part(enc("4 ✓") + [E], 1)
    part(enc("\n"), 0)
    part([S] + enc("user\nand ½ + ½?") + [E] + enc("\n"), 0)
    part([S] + enc("assistant\n"), 0)
    part(enc("1, naturellement 🙂") + [E], 1)
    part(enc("\n"), 0)
    assert tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"] == ids
    job = submit(stack, [{"messages": msgs, "id": "chat"}])
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        got = list(s)
    assert len(got) == 1
    assert got[0].token_ids.tolist() == ids
    assert got[0].loss_mask.int().tolist() == mask
    assert got[0].label == "chat" and got[0].hidden_states.shape == (len(ids), 4, 128)


def test_token_ids_are_vllms_own_tokenisation(stack):
    """What the sidecar sends for a prompt and for a chat is what `vllm serve` makes of the same
    text (its /tokenize: a prompt with the tokenizer's special tokens, a chat rendered by the
    template with none added)."""
    prompt = "Token ids as vLLM sees them: ünïcödé 🚀 中文 שלום"
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Grüß dich! 2+2?"},
        {"role": "assistant", "content": "4 ✓"},
    ]
    job = submit(stack, [{"prompt": prompt, "id": "prompt"}, {"messages": msgs, "id": "chat"}])
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        got = {x.label: x.token_ids.tolist() for x in s}
    vllm = stack.env["HSSTREAM_VLLM_URL"]
    want = {
        "prompt": httpx.post(f"{vllm}/tokenize", json={"model": "verifier", "prompt": prompt}, timeout=30),
        "chat": httpx.post(f"{vllm}/tokenize", json={"model": "verifier", "messages": msgs,
                                                     "add_generation_prompt": False}, timeout=30),
    }  # fmt: skip
    assert all(r.status_code == 200 for r in want.values()), [r.text for r in want.values()]
    assert got == {k: r.json()["tokens"] for k, r in want.items()}


def test_dataset_rows_token_ids_are_vllms_own_tokenisation(stack):
    """Rows as datasets ship them (issue 24.1: content-part lists, an assistant turn with
    tool_calls and null content, a tool result as parts, tools, a ShareGPT row's extra key):
    the ids the sidecar sends are those vLLM's /tokenize makes of the same chat request."""
    from tests.unit.server.test_sidecar_data_rows import PARTS, TOOL_CHAT, TOOLS

    tool_parts = [*TOOL_CHAT[:2], {**TOOL_CHAT[2], "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  TOOL_CHAT[3]]  # fmt: skip
    rows = {"parts": {"messages": PARTS}, "tools": {"messages": TOOL_CHAT, "tools": TOOLS},
            "tool-parts": {"messages": tool_parts, "tools": TOOLS, "model": "gpt-4"}}  # fmt: skip
    job = submit(stack, [{"id": k, **v} for k, v in rows.items()])
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        got = {x.label: x.token_ids.tolist() for x in s}
    vllm = stack.env["HSSTREAM_VLLM_URL"]
    want = {}
    for k, v in rows.items():
        body = {"model": "verifier", "messages": v["messages"], "add_generation_prompt": False}
        r = httpx.post(f"{vllm}/tokenize", json={**body, **({"tools": v["tools"]} if "tools" in v else {})}, timeout=30)
        assert r.status_code == 200, r.text
        want[k] = r.json()["tokens"]
    assert got == want


def test_paused_trainer_spool_stays_under_budget_then_drains(layout_stack):
    stack = layout_stack
    n = 16
    job = submit(stack, token_samples(n, 40, seed=1))
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], spool_bytes(stack))
            time.sleep(0.02)

    t = threading.Thread(target=watch)
    t.start()
    try:
        # No trainer: production must stop at the budget (some READY, the rest QUEUED, none in
        # flight, the same twice in a row), however long the engine takes to get there.
        t0, prev = time.time(), None
        while True:
            c = status(stack, job)["counts"]
            if c["ready"] >= 1 and c["submitted"] == 0 and c == prev:
                break
            assert time.time() - t0 < 120, c
            prev = c
            time.sleep(0.5)
        assert c["queued"] > 0, c
        assert 0 < peak[0] <= BUDGET
        with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
            got = [x.key for x in s]  # the keys only: an arena slot's views would hold its bytes
    finally:
        stop.set()
        t.join()
    assert len(got) == n and peak[0] <= BUDGET, peak
    assert status(stack, job)["counts"]["consumed"] == n
    assert wait_spool_empty(stack, timeout=30) == []


def test_trainer_killed_then_new_trainer(layout_stack, tmp_path):
    stack = layout_stack
    n = 12
    job = submit(stack, token_samples(n, 30, seed=2))
    log1, log2 = tmp_path / "t1.jsonl", tmp_path / "t2.jsonl"
    t1 = start_trainer(stack, log1, job, "--hang-after", "5")
    t0 = time.time()
    while not any("hang" in x for x in read_log(log1)):
        assert time.time() - t0 < 120 and t1.poll() is None, read_log(log1)
        time.sleep(0.2)
    os.killpg(t1.pid, signal.SIGKILL)
    t1.wait(10)
    t2 = start_trainer(stack, log2, job)
    assert t2.wait(240) == 0
    a1 = [x["acked"] for x in read_log(log1) if "acked" in x]
    a2 = [x["acked"] for x in read_log(log2) if "acked" in x]
    used1 = [x["used"] for x in read_log(log1) if "used" in x]
    assert len(a1) == 4 and len(used1) == 5
    assert used1[-1] in a2  # used but never acked by the dead trainer: produced again
    check_invariant(stack, job, n, [a1, a2])


@pytest.mark.parametrize("victim", ["sidecar", "vllm"])
def test_process_killed_mid_job_and_restarted(layout_stack, tmp_path, victim):
    """SIGKILL the sidecar (ledger recovery, trainer resumes by heartbeat) or vLLM (in-flight
    samples resubmitted); either way the running trainer completes the job exactly once. With the
    arena the restarted sidecar keeps the arena and its READY slots; a killed engine's slots go
    into quarantine. The trainer keeps its first two samples' tensors as yielded (an arena slot's
    views) through it all: their values never change (issue 40: a restarted sidecar reused the
    slots a heart-beating trainer still viewed)."""
    stack = layout_stack
    n = 12
    job = submit(stack, token_samples(n, 30, seed=3 if victim == "sidecar" else 4))
    log = tmp_path / "t.jsonl"
    tr = start_trainer(stack, log, job, "--sleep-per-sample", "0.4", "--hold-views", "2")
    t0 = time.time()
    while sum("acked" in x for x in read_log(log)) < 3:
        assert time.time() - t0 < 120 and tr.poll() is None
        time.sleep(0.1)
    url = f"{stack.api}/healthz" if victim == "sidecar" else f"http://127.0.0.1:{stack.vllm_port}/health"
    restart(stack, victim, url)
    assert tr.wait(300) == 0, read_log(log)
    acked = [x["acked"] for x in read_log(log) if "acked" in x]
    check_invariant(stack, job, n, [acked])
    assert [x["held_views_unchanged"] for x in read_log(log) if "held_views_unchanged" in x] == [True]


def test_trainer_messages_reaching_a_restarted_sidecar_late_leave_no_file(stack):
    """The race the test above once lost (3 files left): a trainer reads and deletes its sample
    while the sidecar is down, and its RECEIVED and ACK reach the restarted sidecar only after
    that produced the sample again (its file READY). Here the trainer's messages wait until
    then for certain: its socket is closed over the restart and a new one sends them."""
    import zmq

    from connector import protocol as P

    job = submit(stack, token_samples(1, 30, seed=7))
    hello = P.Hello(jobs=[job])
    ctx = zmq.Context.instance()
    old = ctx.socket(zmq.DEALER)
    old.connect(stack.delivery_endpoint)
    old.send_multipart(P.encode_msg(hello))
    old.send_multipart(P.encode_msg(P.Credit(n=1)))
    msg = None
    while not isinstance(msg, P.Deliver):
        assert old.poll(120_000), "no delivery"
        msg = P.decode_msg(old.recv_multipart())
    key, first = msg.notice.key, msg.notice.file
    old.close(linger=0)
    restart(stack, "sidecar", f"{stack.api}/healthz", while_down=lambda: (stack.spool / first).unlink())
    t0 = time.time()
    while status(stack, job)["counts"]["ready"] < 1:  # recovered QUEUED (file gone), produced again
        assert time.time() - t0 < 120, status(stack, job)
        time.sleep(0.1)
    assert len(stack.spool_files()) == 1 and first not in stack.spool_files()
    new = ctx.socket(zmq.DEALER)
    new.connect(stack.delivery_endpoint)
    try:
        held = {"keys": [key], "tokens": [msg.token]}  # the lease's token, kept in the restarted ledger
        for body in (P.Heartbeat(hello=hello, window=0), P.Received(**held), P.Ack(**held)):
            new.send_multipart(P.encode_msg(body))
        st = wait_done(stack, job)
        assert st["counts"]["consumed"] == 1, st
        time.sleep(1.0)  # a file of a further attempt, if one was made, has come ...
        left = wait_spool_empty(stack, timeout=30)  # ... and gone
        assert left == [], spool_leak_report(stack, left)
    finally:
        new.close(linger=0)


def test_delete_running_job_leaves_no_file_and_no_request(layout_stack):
    stack = layout_stack
    job = submit(stack, token_samples(30, 60, seed=5))  # no trainer: files pile up to the budget
    t0 = time.time()
    while status(stack, job)["counts"]["ready"] < 1:
        assert time.time() - t0 < 120
        time.sleep(0.1)
    r = httpx.delete(f"{stack.api}/v1/jobs/{job}", timeout=30, headers=stack.headers)
    assert r.status_code == 200
    c = r.json()["counts"]
    assert c["cancelled"] + c["consumed"] + c["failed"] == 30 and c["cancelled"] > 0
    # Late notices of aborted requests are discarded with their files, and vLLM runs none of
    # ours any more: waited for (each is a step of another process), not slept on.
    t0 = time.time()
    while True:
        m = httpx.get(f"http://127.0.0.1:{stack.vllm_port}/metrics", timeout=10).text
        vals = {ln.split("{")[0]: float(ln.split()[-1]) for ln in m.splitlines()
                if ln.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))}  # fmt: skip
        left = stack.spool_files() + ([f"{h} arena slot(s) held"] if (h := stack.held_slots()) else [])
        if left == [] and vals and all(v == 0 for v in vals.values()) or time.time() - t0 > 60:
            break
        time.sleep(0.2)
    assert left == [], spool_leak_report(stack, left)
    assert vals and all(v == 0 for v in vals.values()), vals


def test_remote_trainer_over_curve_gets_bytes_and_sidecar_deletes(layout_stack):
    stack = layout_stack
    n = 5
    samples = token_samples(n, 30, seed=6)
    job = submit(stack, samples)
    k = stack.keys
    # A trainer whose key the sidecar does not know gets nothing (CURVE refuses it) ...
    with pytest.raises(StreamError, match="no sample"):
        with HiddenStateStream(f"tcp://127.0.0.1:{stack.remote_port}", jobs=[job], timeout_s=4,
                               curve_server_key=str(k / "server.key"),
                               curve_client_cert=str(k / "stranger.key_secret")) as s:  # fmt: skip
            list(s)
    # ... and loses nothing: an authorised one gets every sample, as bytes.
    with HiddenStateStream(f"tcp://127.0.0.1:{stack.remote_port}", jobs=[job], timeout_s=60,
                           curve_server_key=str(k / "server.key"),
                           curve_client_cert=str(k / "clients" / "trainer.key_secret")) as s:  # fmt: skip
        got = list(s)
        stats = dict(s.stats)
    assert sorted(x.label for x in got) == sorted(x["id"] for x in samples) and stats["invalid"] == 0
    by = {x.label: x for x in got}
    for smp in samples:
        assert by[smp["id"]].token_ids.tolist() == smp["token_ids"]
        assert by[smp["id"]].hidden_states.shape == (30, 4, 128)
    st = wait_done(stack, job)
    assert st["counts"]["consumed"] == n
    assert wait_spool_empty(stack, timeout=30) == []  # deleted by the sidecar on RECEIVED
    assert httpx.get(f"{stack.api}/v1/stats", timeout=10, headers=stack.headers).json()["delivery"]["delivered_remote"] >= n


def test_regenerate_mode_extracts_prompt_plus_new_reply(stack, tiny_model):
    from transformers import AutoTokenizer

    from tests.integration.connector.test_e2e_hidden_states import assert_close_to_hf

    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [{"role": "user", "content": "count: 1 2 3"}, {"role": "assistant", "content": "old reply, dropped"}]
    prompt = tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    job = submit(stack, [{"messages": msgs, "id": "regen"}], mode="regenerate",
                 sampling={"max_tokens": 8, "temperature": 0.0})  # fmt: skip
    with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
        got = list(s)
    assert len(got) == 1
    g = got[0]
    ids = g.token_ids.tolist()
    reply = ids[len(prompt):]
    assert ids[: len(prompt)] == list(prompt) and 1 <= len(reply) <= 7  # prompt + reply - 1 positions
    assert g.loss_mask.int().tolist() == [0] * len(prompt) + [1] * len(reply)
    assert g.hidden_states.shape[0] == len(ids)
    assert_close_to_hf(tiny_model, g, [2, 6, 9, 12])  # the reply's states are the verifier's too
    assert stack.spool_files() == []


def test_regenerate_draws_a_fresh_reply_each_epoch_and_the_same_on_a_rerun(stack):
    """With a seed, epoch 0 samples with it and each later epoch with its own seed derived from
    it (``epoch_seed``): at T=1 most replies differ between epochs (the reason to regenerate
    every epoch), and a second job with the same options draws (nearly all) the same replies."""
    msgs = [[{"role": "user", "content": f"say something about {w}"}] for w in
            ("tea", "rain", "maps", "owls", "salt", "wind", "clocks", "bread", "glass", "ships")]  # fmt: skip
    opts = {"mode": "regenerate", "epochs": 2, "sampling": {"max_tokens": 10, "temperature": 1.0, "seed": 123}}

    def replies(job):
        out: dict[tuple[int, int], tuple] = {}
        with HiddenStateStream(stack.delivery_endpoint, jobs=[job], spool_dir=stack.spool, timeout_s=120) as s:
            for smp in s:
                out[(smp.key.epoch, smp.key.index)] = tuple(smp.token_ids.tolist())
        return out

    first = replies(submit(stack, [{"messages": m} for m in msgs], **opts))
    assert sorted(first) == [(e, i) for e in (0, 1) for i in range(len(msgs))]
    differ = sum(first[(0, i)] != first[(1, i)] for i in range(len(msgs)))
    assert differ >= len(msgs) // 2, f"only {differ} of {len(msgs)} replies differ between epochs"
    again = replies(submit(stack, [{"messages": m} for m in msgs], **opts))
    # The same seeds draw the same replies, epoch for epoch; allowed a few differences, since a
    # batch of other shapes may move a logit's last bit and flip one sampled token.
    same = sum(again[k] == first[k] for k in first)
    assert same >= 0.7 * len(first), f"only {same} of {len(first)} replies drawn again"
