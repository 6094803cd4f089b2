"""The sidecar's REST API and its error paths, on a real uvicorn process (no vLLM behind it:
that is the "dead vLLM" case, and every other check here needs none)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.ledger.store import unpack as _unpack
from tests.integration.conftest import sidecar_without_vllm

TOKEN = "s3cret"


@contextlib.contextmanager
def start_sidecar(model: str):
    limits = {"HSSTREAM_VLLM_DOWN_DEADLINE_S": "3", "HSSTREAM_MAX_BODY_BYTES": "200000",
              "HSSTREAM_MAX_JSON_BYTES": "200000", "HSSTREAM_SPOOL_BUDGET_BYTES": "2000000"}  # fmt: skip
    with sidecar_without_vllm(model, TOKEN, "hsstream-api-", **limits) as sc:
        with httpx.Client(base_url=sc.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
            yield c, sc.env


@pytest.fixture(scope="module")
def sidecar(tiny_model):
    with start_sidecar(tiny_model) as c_env:
        yield c_env


@pytest.fixture(scope="module")
def unmarked_sidecar(tiny_model, tmp_path_factory):
    """A sidecar whose verifier is the tiny model with its template's generation markers removed,
    as most real templates come."""
    d = tmp_path_factory.mktemp("tiny-unmarked")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model) / f, d / f)
    marked = (Path(tiny_model) / "chat_template.jinja").read_text()
    markers = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
    unmarked = markers.sub("", marked)
    assert markers.search(marked) and not markers.search(unmarked)
    (d / "chat_template.jinja").write_text(unmarked)
    with start_sidecar(str(d)) as c_env:
        yield c_env


def post(c, samples, **options):
    return c.post("/v1/jobs", json={"samples": samples, "options": options})


def test_bearer_token_required_except_health(sidecar):
    c, _ = sidecar
    assert httpx.get(f"{c.base_url}/v1/jobs").status_code == 401
    assert "bearer token" in httpx.get(f"{c.base_url}/v1/jobs").json()["detail"]
    assert httpx.get(f"{c.base_url}/healthz").status_code == 200
    assert c.get("/v1/jobs").status_code == 200
    # every other route (from the schema, so a new route is covered too), /metrics and the schema itself
    # included, needs the token; a wrong one (a prefix, or one character more) is refused
    schema = c.get("/openapi.json").json()["paths"]
    routes = [(m.upper(), p.replace("{job_id}", "x")) for p, ops in schema.items() for m in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs")]
    assert ("GET", "/metrics") in routes and len(routes) >= 10, routes
    for method, path in routes:
        want = 200 if path in ("/healthz", "/readyz") else 401
        for hdr in ({}, {"authorization": f"Bearer {TOKEN[:-1]}"}, {"authorization": f"Bearer {TOKEN}x"}):
            got = httpx.request(method, f"{c.base_url}{path}", headers=hdr).status_code
            assert (got == 401) == (want == 401), (method, path, hdr, got)


def test_bad_json_is_422(sidecar):
    c, _ = sidecar
    r = c.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


def test_sample_with_two_kinds_names_the_field(sidecar):
    c, _ = sidecar
    r = post(c, [{"prompt": "a"}, {"prompt": "b", "token_ids": [1]}])
    assert r.status_code == 422
    d = r.json()["detail"][0]
    assert d["loc"][:3] == ["body", "samples", 1] and "exactly one of" in d["msg"]


def test_empty_prompt_and_too_long_are_listed_by_index(sidecar):
    c, _ = sidecar
    r = post(c, [{"prompt": "fine"}, {"prompt": ""}, {"token_ids": list(range(100)) * 30}], max_tokens_per_sample=512)
    assert r.status_code == 422
    bad = {b["index"]: b["reason"] for b in r.json()["detail"]["samples"]}
    assert bad[1] == "empty prompt"
    assert "3000 tokens, more than the limit of 512" in bad[2]
    assert 0 not in bad


def test_token_ids_outside_vocab_refused(sidecar):
    c, _ = sidecar
    r = post(c, [{"token_ids": [1, 2, 99999]}])
    assert r.status_code == 422 and "outside the vocabulary" in r.json()["detail"]["samples"][0]["reason"]


def test_skip_mode_runs_the_rest(sidecar):
    c, _ = sidecar
    r = post(c, [{"prompt": "ok one"}, {"prompt": ""}], on_invalid="skip")
    assert r.status_code == 200 and r.json()["num_samples"] == 1 and r.json()["num_failed_at_submission"] == 1


def test_truncate_mode(sidecar):
    c, _ = sidecar
    r = post(c, [{"token_ids": list(range(50))}], max_tokens_per_sample=10, overlong="truncate")
    assert r.status_code == 200
    job = r.json()["job_id"]
    counts = c.get(f"/v1/jobs/{job}/token_counts").json()
    assert counts["total_tokens"] == 10 and counts["vocab_size"] == 512


def test_sample_larger_than_the_whole_spool_is_refused(sidecar):
    c, _ = sidecar
    r = post(c, [{"token_ids": [5] * 2000}])  # 2000 tokens x 4 KiB/token > 2 MB budget
    assert r.status_code == 422 and "more than the whole spool budget" in r.json()["detail"]["samples"][0]["reason"]


def test_oversize_body_is_413(sidecar):
    c, _ = sidecar
    r = post(c, [{"prompt": "x" * 300_000}])
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]


def test_unknown_job_is_404(sidecar):
    c, _ = sidecar
    for r in (c.get("/v1/jobs/nope"), c.delete("/v1/jobs/nope"), c.get("/v1/jobs/nope/token_counts")):
        assert r.status_code == 404 and "unknown job 'nope'" in r.json()["detail"]


def test_dead_vllm_not_ready_jobs_wait_then_fail_with_reason(sidecar):
    c, _ = sidecar
    r = c.get("/readyz")
    assert r.status_code == 503 and "not reachable" in r.json()["problems"][0]
    job = post(c, [{"prompt": "waits for vLLM"}]).json()["job_id"]
    deadline = time.time() + 30
    while time.time() < deadline:
        st = c.get(f"/v1/jobs/{job}").json()
        if st["done"]:
            break
        time.sleep(0.5)
    assert st["counts"]["failed"] == 1 and "unreachable for more than 3 s" in st["errors"][0]["errors"][-1]


def test_chat_and_sharegpt_token_counts_follow_the_mask(sidecar):
    c, _ = sidecar
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]
    a = post(c, [{"messages": msgs}]).json()["job_id"]
    b = post(c, [{"conversations": conv}]).json()["job_id"]
    ca, cb = (c.get(f"/v1/jobs/{j}/token_counts").json() for j in (a, b))
    assert ca == {**cb, "job_id": a}  # ShareGPT is the same conversation
    assert 0 < sum(ca["counts"].values()) < ca["total_tokens"]  # only assistant tokens counted


def test_jsonl_upload_and_cli(sidecar, tmp_path):
    c, env = sidecar
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"nope": 1}\n')
    r = c.post("/v1/jobs/upload", files={"file": ("bad.jsonl", bad.read_bytes())})
    assert r.status_code == 422 and r.json()["detail"]["lines"][0]["line"] == 2
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"prompt": f"line {i}", "id": str(i)}) for i in range(3)) + "\n")
    p = subprocess.run([sys.executable, "-m", "hsstream", "submit", str(good), "--url", str(c.base_url),
                        "--options", '{"epochs": 2}'], env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    st = c.get(f"/v1/jobs/{job}").json()
    assert st["num_samples"] == 6  # 3 samples x 2 epochs
    p = subprocess.run([sys.executable, "-m", "hsstream", "status", job, "--url", str(c.base_url)],
                       env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0 and json.loads(p.stdout)["job_id"] == job


def test_jsonl_upload_with_a_utf8_bom(sidecar):
    c, _ = sidecar
    body = "\ufeff" + "\n".join(json.dumps({"prompt": f"line {i}"}) for i in range(2)) + "\n"
    r = c.post("/v1/jobs/upload", files={"file": ("bom.jsonl", body.encode("utf-8"))})
    assert r.status_code == 200, r.text
    assert r.json()["num_samples"] == 2 and r.json()["num_failed_at_submission"] == 0


def test_wrong_content_type_names_the_expected_one(sidecar):
    c, _ = sidecar
    body = json.dumps({"samples": [{"prompt": "a"}]})
    r = c.post("/v1/jobs", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"] and "text/plain" in r.json()["detail"]
    r = c.post("/v1/jobs/upload", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["detail"]
    r = c.post("/v1/jobs", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_delete_cancels_queued_job(sidecar):
    c, _ = sidecar
    job = post(c, [{"prompt": "a"}, {"prompt": "b"}]).json()["job_id"]
    r = c.delete(f"/v1/jobs/{job}")
    assert r.status_code == 200 and r.json()["counts"]["cancelled"] + r.json()["counts"]["failed"] == 2
    assert c.get(f"/v1/jobs/{job}").json()["done"]


def test_metrics_exposed(sidecar):
    c, _ = sidecar
    m = c.get("/metrics").text
    assert "hsstream_samples_total" in m and "hsstream_spool_reserved_bytes" in m and "hsstream_vllm_request_seconds" in m


CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue 🌊, 青, כחול."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": ""}],
]  # fmt: skip


def ledger_masks(env, job):
    """(token ids, loss mask) per sample as the sidecar recorded them for delivery."""
    path = Path(env["HSSTREAM_RUN_DIR"]) / "ledger.sqlite"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT token_ids, loss_mask FROM samples WHERE job_id=? AND epoch=0 ORDER BY idx", (job,))
        return [(_unpack(ids), _unpack(mask)) for ids, mask in rows]


def test_template_without_generation_markers_gives_the_marked_masks(sidecar, unmarked_sidecar, tiny_model):
    from transformers import AutoTokenizer

    samples = [{"messages": m} for m in CHATS] + [{"conversations": [{"from": "human", "value": "hi"},
                                                                      {"from": "gpt", "value": "hello there"}]}]  # fmt: skip
    jobs = []
    for c, _ in (sidecar, unmarked_sidecar):
        r = post(c, samples)
        assert r.status_code == 200 and r.json()["num_failed_at_submission"] == 0, r.text
        jobs.append(r.json()["job_id"])
    marked, unmarked = ledger_masks(sidecar[1], jobs[0]), ledger_masks(unmarked_sidecar[1], jobs[1])
    assert len(unmarked) == len(samples) and all(any(mask) for _, mask in unmarked)
    assert unmarked == marked
    tok = AutoTokenizer.from_pretrained(tiny_model)  # the marked template's own masks, from transformers
    for msgs, (ids, mask) in zip(CHATS, marked):
        out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert (ids, mask) == (out["input_ids"], out["assistant_masks"])
    counts = [c.get(f"/v1/jobs/{j}/token_counts").json() for (c, _), j in zip((sidecar, unmarked_sidecar), jobs)]
    assert counts[1]["counts"] and counts[1]["counts"] == counts[0]["counts"]
    assert sum(counts[1]["counts"].values()) == sum(sum(m) for _, m in unmarked) < counts[1]["total_tokens"]


def test_conversation_without_assistant_turn_is_invalid_with_the_reason(unmarked_sidecar):
    c, _ = unmarked_sidecar
    no_reply = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]}
    r = post(c, [{"messages": CHATS[0]}, no_reply])
    assert r.status_code == 422 and "nothing was queued" in r.json()["detail"]["message"]
    bad = r.json()["detail"]["samples"]
    assert [b["index"] for b in bad] == [1]
    assert "no assistant tokens to train on (roles in the conversation: system, user)" in bad[0]["reason"]
    r = post(c, [{"messages": CHATS[0]}, no_reply], on_invalid="skip")
    assert r.status_code == 200 and r.json()["num_samples"] == 1 and r.json()["num_failed_at_submission"] == 1
    r = post(c, [no_reply], loss_mask="all")  # every token carries loss: a valid sample
    assert r.status_code == 200 and r.json()["num_failed_at_submission"] == 0
