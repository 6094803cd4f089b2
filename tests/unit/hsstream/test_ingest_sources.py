"""``hsstream submit`` / ``hsstream train --submit`` from files and datasets (issue 24 item 3):
every format, the presets and ``--field`` mappings, ``--limit`` and ``--shuffle``, uploaded
through the real sidecar app (tiny tokenizer, no vLLM) and checked by what the ledger stored;
and the upload body made on the fly (a source consumed as the body is, memory flat in rows)."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest
from fastapi.testclient import TestClient

from connector.contract.rest_client import SidecarClient, multipart_jsonl
from connector.contract.settings import Settings
from trainer_client import data_sources as DS
from hsstream import rest_client as RC
from server.app import create_app

ROWS = [
    {"id": "p0", "prompt": "The capital of France is"},
    {"id": "c0", "messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]},
    {"id": "s0", "conversations": [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello."}]},
    {"id": "t0", "token_ids": [100, 200, 300, 400]},
]


@pytest.fixture
def client(tmp_path, tiny_model):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 model=tiny_model)  # fmt: skip
    return TestClient(create_app(s), raise_server_exceptions=False)  # no lifespan: nothing is sent to vLLM


@pytest.fixture
def cli_submit(client, monkeypatch):
    """``hsstream submit``'s code (rest_client.submit) against the app; returns (exit code, job)."""
    monkeypatch.setattr(RC, "_client", lambda url: SidecarClient(http=client, token=""))
    out: dict = {}
    real = getattr(RC, "upload_samples", None)

    def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        out["job"] = real(*a, **kw)
        return out["job"]

    monkeypatch.setattr(RC, "upload_samples", spy, raising=False)

    def run(path, options="{}", **kw):  # noqa: ANN001, ANN003, ANN202
        out.clear()
        code = RC.submit(str(path), options, None, False, **kw)
        return code, out.get("job")

    return run


def stored_labels(client, job_id):
    return [s.label for s in client.app.state.services.ledger.job_samples(job_id)]


def stored(client, job_id):
    return list(client.app.state.services.ledger.iter_token_ids(job_id, epoch=0))


def reference(client, rows):
    """What the sidecar stores for the same rows posted as one JSON body (today's path)."""
    r = client.post("/v1/jobs", json={"samples": rows, "options": {"loss_mask": "all"}})
    assert r.status_code == 200, r.text
    return stored(client, r.json()["job_id"])


def write_jsonl(path, rows, opener=open):  # noqa: ANN001
    with opener(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def to_table(rows):
    """A table with every row's columns (from_pylist would take the first row's keys only)."""
    import pyarrow as pa

    return pa.Table.from_struct_array(pa.array(rows))


# ---------------------------------------------------------------- every format, through the app


def _jsonl(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", ROWS)


def _jsonl_gz(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl.gz", ROWS, gzip.open)


def _json_array(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(ROWS, indent=2))
    return p


def _parquet(tmp_path):
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(to_table(ROWS), p, row_group_size=2)
    return p


def _feather(tmp_path):
    import pyarrow.feather as feather

    p = tmp_path / "d.feather"
    feather.write_feather(to_table(ROWS), p, chunksize=2)
    return p


def _arrow_stream(tmp_path):
    import pyarrow as pa

    p = tmp_path / "d.arrow"
    t = to_table(ROWS)
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        for b in t.to_batches(max_chunksize=2):
            w.write_batch(b)
    return p


def _datasets_folder(tmp_path):
    import datasets

    p = tmp_path / "saved"
    datasets.Dataset(to_table(ROWS)).save_to_disk(str(p))
    return p


FORMATS = {"jsonl": _jsonl, "jsonl.gz": _jsonl_gz, "json": _json_array, "parquet": _parquet, "feather": _feather,
           "arrow-stream": _arrow_stream, "datasets-save_to_disk": _datasets_folder}  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_is_uploaded_and_stored_as_the_same_rows_posted_as_json(fmt, tmp_path, client, cli_submit):
    code, job = cli_submit(FORMATS[fmt](tmp_path), '{"loss_mask": "all"}')
    assert code == 0 and job is not None
    assert job.num_samples == 4 and job.num_failed_at_submission == 0
    assert job.warnings == []  # columnar nulls (a prompt row's messages) are not sent
    assert stored_labels(client, job.job_id) == ["p0", "c0", "s0", "t0"]
    assert stored(client, job.job_id) == reference(client, ROWS)


def test_a_datasets_dict_folder_needs_split_and_takes_it(tmp_path, client, cli_submit):
    import datasets

    p = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset(to_table(ROWS[:2])), "test": datasets.Dataset(to_table(ROWS[3:]))}
                         ).save_to_disk(str(p))  # fmt: skip
    assert cli_submit(p)[0] == 2  # splits [train, test]: pass --split
    code, job = cli_submit(p, split="test")
    assert code == 0 and stored_labels(client, job.job_id) == ["t0"]


def test_a_datasets_name_is_loaded_offline_with_split(tmp_path, client, cli_submit, monkeypatch):
    """``load_dataset(name, split=...)`` with HF_DATASETS_OFFLINE=1 (no hub here): a local
    folder of parquet files, which datasets resolves as it resolves a cached name."""
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    d = tmp_path / "org-name" / "data"
    d.mkdir(parents=True)
    pq.write_table(to_table(ROWS), d / "train-00000-of-00001.parquet")
    code, job = cli_submit(tmp_path / "org-name", split="train")
    assert code == 0 and stored_labels(client, job.job_id) == ["p0", "c0", "s0", "t0"]
    assert cli_submit("no-such-org/no-such-dataset", split="train")[0] == 2  # offline, not cached: one line


def test_parquet_was_refused_by_the_old_upload_and_a_missing_file_is_still_exit_2(tmp_path, client, cli_submit):
    """The old `hsstream submit` sent the file's bytes as JSONL: the sidecar answered a parquet
    file with "bad line(s) ... Invalid JSON"; now its rows are read and sent."""
    p = _parquet(tmp_path)
    r = client.post("/v1/jobs/upload", files={"file": (p.name, p.read_bytes())}, data={"options": "{}"})
    assert r.status_code == 422 and "Invalid JSON" in r.text
    assert cli_submit(p)[0] == 0
    assert cli_submit(tmp_path / "missing.jsonl")[0] == 2


# ---------------------------------------------------------------- presets and --field


SHAREGPT = [{"id": f"sg{i}", "model": "gpt-4", "conversations": [{"from": "human", "value": f"Hi {i}!"},
                                                                 {"from": "gpt", "value": "Hello."}]} for i in range(3)]  # fmt: skip
ULTRACHAT = [{"prompt": f"Name {i} colours.", "prompt_id": f"u{i}",
              "messages": [{"role": "user", "content": f"Name {i} colours."}, {"role": "assistant", "content": "Red."}]}
             for i in range(3)]  # fmt: skip
OPENAI = [{"id": f"o{i}", "messages": [{"role": "user", "content": "Weather?"},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"type": "function", "function": {"name": "get", "arguments": "{}"}}]}],
           "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}],
           "source": "x"} for i in range(2)]  # fmt: skip


@pytest.mark.parametrize(("preset", "rows", "want_ids", "keys"), [
    ("sharegpt", SHAREGPT, ["sg0", "sg1", "sg2"], ("conversations",)),
    ("ultrachat", ULTRACHAT, ["u0", "u1", "u2"], ("prompt", "messages")),
    ("openai", OPENAI, ["o0", "o1"], ("messages", "tools")),
])  # fmt: skip
def test_presets_take_speculators_column_names(preset, rows, want_ids, keys, tmp_path, client, cli_submit):
    p = tmp_path / "rows.parquet"
    import pyarrow.parquet as pq

    pq.write_table(to_table(rows), p)
    code, job = cli_submit(p, '{"loss_mask": "all"}', preset=preset)
    assert code == 0 and job.num_failed_at_submission == 0
    assert job.warnings == []  # a preset sends only its fields: model / source / ... stay home
    assert stored_labels(client, job.job_id) == want_ids
    mapped = [{"id": i, **{k: r[k] for k in keys}} for i, r in zip(want_ids, rows, strict=True)]
    assert stored(client, job.job_id) == reference(client, mapped)


def test_field_maps_other_columns_and_overrides_a_preset(tmp_path, client, cli_submit):
    rows = [{"uid": 7, "question": "What is two plus two?"}, {"uid": 8, "question": "And three?"}]
    p = write_jsonl(tmp_path / "q.jsonl", rows)
    code, job = cli_submit(p, fields=["prompt=question", "id=uid"])
    assert code == 0 and stored_labels(client, job.job_id) == ["7", "8"]  # an int id sent as text
    assert stored(client, job.job_id) == reference(client, [{"prompt": r["question"]} for r in rows])
    rows = [{"conv_id": "a", "dialog": SHAREGPT[0]["conversations"]}]
    p = write_jsonl(tmp_path / "sg.jsonl", rows)
    code, job = cli_submit(p, preset="sharegpt", fields=["conversations=dialog", "id=conv_id"])
    assert code == 0 and stored_labels(client, job.job_id) == ["a"]
    code, job = cli_submit(p, fields=["text=dialog"])
    assert code == 2 and job is None  # not a sample field: refused before anything is sent


def test_nested_column_with_a_dot(tmp_path, client, cli_submit):
    p = write_jsonl(tmp_path / "n.jsonl", [{"meta": {"q": "Hello there"}, "k": "n1"}])
    code, job = cli_submit(p, fields=["prompt=meta.q", "id=k"])
    assert code == 0 and stored_labels(client, job.job_id) == ["n1"]


# ---------------------------------------------------------------- --limit, --shuffle


def test_limit_sends_the_first_n_rows_and_stops_reading(tmp_path, client, cli_submit):
    rows = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(50)]
    p = write_jsonl(tmp_path / "r.jsonl", rows)
    code, job = cli_submit(p, limit=7)
    assert code == 0 and stored_labels(client, job.job_id) == [f"r{i}" for i in range(7)]
    with p.open("a") as f:
        f.write("not json\n")  # past the limit: never read
    assert cli_submit(p, limit=50)[0] == 0
    assert cli_submit(p)[0] == 2  # read to the end: the bad line is named, nothing queued


def test_shuffle_is_seeded_a_permutation_and_bounded_by_its_buffer(tmp_path, client, cli_submit):
    rows = [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(40)]
    p = write_jsonl(tmp_path / "r.jsonl", rows)
    a = stored_labels(client, cli_submit(p, shuffle=True, seed=1, shuffle_buffer=64)[1].job_id)
    b = stored_labels(client, cli_submit(p, shuffle=True, seed=1, shuffle_buffer=64)[1].job_id)
    c = stored_labels(client, cli_submit(p, shuffle=True, seed=2, shuffle_buffer=64)[1].job_id)
    assert a == b != c and sorted(a) == sorted(r["id"] for r in rows) and a != [r["id"] for r in rows]
    # a buffer of 4 rows: row i leaves no earlier than position i - 4
    out = [int(r["id"][1:]) for r in DS.shuffled(iter(rows), 4, seed=0)]
    assert sorted(out) == list(range(40)) and all(pos >= i - 4 for pos, i in enumerate(out))


# ---------------------------------------------------------------- what the sidecar refused


def test_refused_rows_are_reported_skip_and_reject(tmp_path, client, cli_submit, capsys):
    rows = [{"id": "ok", "prompt": "fine"}, {"id": "bad", "token_ids": [10**9]}]
    p = write_jsonl(tmp_path / "r.jsonl", rows)
    code, job = cli_submit(p)  # skip: hsstream submit's default (hsstream/job_options.py)
    assert code == 0 and job.num_failed_at_submission == 1
    assert "skipped 1" in capsys.readouterr().err
    code, job = cli_submit(p, '{"on_invalid": "reject"}')
    assert code == 1 and job is None
    assert "nothing was queued" in capsys.readouterr().err


# ---------------------------------------------------------------- the body is made on the fly


def test_the_body_consumes_its_source_as_it_is_read():
    """An endless source: each chunk of the body takes only the rows it holds."""
    taken = 0

    def endless():
        nonlocal taken
        while True:
            taken += 1
            yield {"prompt": "x" * 100}

    body = multipart_jsonl(endless(), boundary="b", chunk_bytes=4096)
    head = next(body)
    assert b'name="options"' in head and b'name="file"' in head and taken == 0
    first = next(body)
    assert 4096 <= len(first) < 4096 + 200 and taken == first.count(b"\n")
    next(body)
    assert taken < 2 * 4096 // 100 + 2


def test_the_body_memory_is_flat_in_the_number_of_rows():
    def rows(n):
        for i in range(n):
            yield {"id": f"r{i}", "messages": [{"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "a" * 200}]}

    def peak(n):
        tracemalloc.start()
        sent = sum(len(c) for c in multipart_jsonl(rows(n), boundary="b"))
        _, pk = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return sent, pk

    small, big = peak(2_000), peak(40_000)
    assert big[0] > 15 * small[0] > 0  # 20x the rows sent ...
    assert big[1] < 2 * small[1] + 256 * 1024  # ... in the same memory (one chunk of 64 KiB and a row)
    assert big[1] < 1 * 2**20


def test_the_body_parses_as_the_upload_form(client):
    body = b"".join(multipart_jsonl(iter(ROWS), boundary="xyz", options='{"epochs": 2}', filename='a"b.jsonl'))
    r = client.post("/v1/jobs/upload", content=body, headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert r.status_code == 200, r.text
    assert r.json()["num_samples"] == 8


# ---------------------------------------------------------------- the JSON array reader


def test_json_array_reader_reads_items_across_window_edges(tmp_path):
    rows = [{"id": f"r{i}", "prompt": "é" * (i * 37 % 300), "n": i * 1.5} for i in range(200)]
    p = tmp_path / "a.json"
    p.write_text(json.dumps(rows))
    assert list(DS.iter_json_array(p, chunk=64)) == rows
    p.write_text("  [ ]  ")
    assert list(DS.iter_json_array(p)) == []
    p.write_text('{"prompt": "x"}')
    with pytest.raises(DS.DataSourceError, match="not a JSON array"):
        list(DS.iter_json_array(p))
    p.write_text('[{"prompt": "x"} {"prompt": "y"}]')
    with pytest.raises(DS.DataSourceError, match="expected ','"):
        list(DS.iter_json_array(p))


# ---------------------------------------------------------------- hsstream train --submit: the same path


def test_train_submit_streams_the_source_through_the_upload(tmp_path, client, monkeypatch):
    import trainer_client.train.run as R
    from hsstream.cli import submit_source

    monkeypatch.setattr(SidecarClient, "http_factory", lambda **kw: TestClient(client.app, base_url=kw["base_url"]))
    import pyarrow.parquet as pq

    p = tmp_path / "u.parquet"
    pq.write_table(to_table(ULTRACHAT), p)
    src = submit_source({"submit_preset": "ultrachat", "submit_limit": 2, "submit_field": ["id=prompt"]}, seed=0)
    assert src == {"preset": "ultrachat", "fields": ["id=prompt"], "limit": 2}
    job = R.submit_job("http://sidecar", R.read_samples(p, **src), {"loss_mask": "all"}, filename=p.name)
    assert stored_labels(client, job) == ["Name 0 colours.", "Name 1 colours."]
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    with pytest.raises(ValueError, match="no samples"):
        R.submit_job("http://sidecar", R.read_samples(empty), {})
    with pytest.raises(ValueError, match="no such file"):
        R.read_samples(tmp_path / "missing.parquet")
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with bad.open("a") as f:
        f.write("{oops\n")
    n_jobs = len(client.app.state.services.ledger.job_ids())
    with pytest.raises(ValueError, match=r"b.jsonl:3: not JSON"):
        R.submit_job("http://sidecar", R.read_samples(bad), {})
    assert len(client.app.state.services.ledger.job_ids()) == n_jobs  # nothing queued


def test_train_submit_records_the_source_and_counts_locally_from_a_second_read(tmp_path, client, monkeypatch, tiny_model):
    import trainer_client.train.run as R
    from trainer_client.train import vocab as V
    from trainer_client.train.config import TrainConfig

    monkeypatch.setattr(SidecarClient, "http_factory", lambda **kw: TestClient(client.app, base_url=kw["base_url"]))
    monkeypatch.setattr(V, "token_counts_from_sidecar", lambda *a, **kw: None)  # counted here instead
    p = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(5)])
    cfg = TrainConfig(verifier=tiny_model, out_dir=str(tmp_path / "run"), device="cpu")
    jobs, counts = R.resolve_jobs_and_counts(cfg, api="http://sidecar", jobs=None, submit_file=str(p), epochs=2,
                                             job_options={"loss_mask": "all"}, token_counts_file=None, api_token=None,
                                             submit_source={"limit": 3})  # fmt: skip
    rec = json.loads((tmp_path / "run" / "jobs.json").read_text())
    assert rec["jobs"] == jobs and rec["source"] == {"limit": 3} and rec["epochs"] == 2
    labels = stored_labels(client, jobs[0])  # 2 epochs, each in its own order
    assert sorted(labels) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    want = V.token_counts_from_samples(tiny_model, [{"prompt": f"row {i}"} for i in range(3)], "all")
    assert counts == want and counts
