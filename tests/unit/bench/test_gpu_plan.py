"""docs/gpu-plan.md's scripts, the parts that run without a GPU: carrying a folder in parts
(checked, refused when incomplete or changed), and the real-model run's checks and commands
(every `hsstream up` / `train` / `eval` flag it uses parsed by our CLI, so a renamed flag
breaks here, not on the device)."""

from __future__ import annotations

import json

import pytest

from bench.gpu_plan import carry as C
from bench.gpu_plan import real_model as RM


def test_a_folder_goes_in_parts_and_comes_back_the_same(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "weights.bin").write_bytes(bytes(range(256)) * 9000)  # ~2.2 MiB
    m = C.pack(src, tmp_path / "parts", "m", part_mib=1)
    assert len(m["parts"]) == 3 and all(p["bytes"] <= 1 << 20 for p in m["parts"])
    calls = C.calls(tmp_path / "parts", "m")
    assert len(calls) == 3 and calls[0]["carry"][1].endswith("m.manifest.json")
    assert all("/root/stash" in c["command"] for c in calls)
    got = C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert (got / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()


def test_a_missing_or_changed_part_is_refused_before_anything_is_extracted(tmp_path, capsys):
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * (3 << 20))
    C.pack(src, tmp_path / "parts", "m", part_mib=1)
    part = tmp_path / "parts" / "m.tar.part01"
    data = part.read_bytes()
    part.write_bytes(data[:-1] + b"y")
    with pytest.raises(SystemExit) as e:
        C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert e.value.code == 4 and "STASH_CORRUPT: m.tar.part01" in capsys.readouterr().out
    part.unlink()
    with pytest.raises(SystemExit) as e:
        C.unpack(tmp_path / "parts", "m", tmp_path / "out")
    assert e.value.code == 3 and "STASH_INCOMPLETE" in capsys.readouterr().out
    assert not (tmp_path / "out" / "m").exists()


def test_the_real_model_runs_commands_parse_and_its_data_is_checked(tmp_path, tiny_model, capsys):
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}?"}, {"from": "gpt", "value": "a."}]}
            for i in range(30)]  # fmt: skip
    (tmp_path / "sg.json").write_text(json.dumps(rows))
    assert RM.make_data(tmp_path / "sg.json", tmp_path / "sg.jsonl", 25) == 25
    base = ["--model", tiny_model, "--data", str(tmp_path / "sg.jsonl"), "--train-samples", "20",
            "--workdir", str(tmp_path / "wd"), "--dry-run"]  # fmt: skip
    assert RM.main([*base, "--eval-prompts", "5", "--draft", "dflash", "--mask-token-id", "3"]) == 0
    out = capsys.readouterr().out
    assert "--submit-preset sharegpt --submit-limit 20 --draft dflash" in out and "--mask-token-id 3" in out
    assert "eval_untrained:" in out and "--no-baseline" in out
    with pytest.raises(SystemExit, match="5 held-out prompts after 20 trained, 6 asked"):
        RM.main([*base, "--eval-prompts", "6"])
    with pytest.raises(SystemExit, match="--draft nope"):
        RM.main([*base, "--eval-prompts", "5", "--draft", "nope"])
