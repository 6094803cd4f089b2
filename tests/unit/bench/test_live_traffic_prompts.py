"""The live-traffic study never replays a prompt D0 was trained on (bench/live_traffic/study.py)."""

from __future__ import annotations

import json

from bench.live_traffic import study


def _sharegpt(path, n):
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question number {i}?"},
                                              {"from": "gpt", "value": "an answer"}]} for i in range(n)]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_the_first_rows_prompts_are_never_replayed_and_the_rest_are(tmp_path):
    p = tmp_path / "sg.jsonl"
    _sharegpt(p, 40)
    trained = study.trained_prompt_digests(str(p), 25)
    assert len(trained) == 25
    got = study.sharegpt_prompts(str(p), 100, exclude=trained)
    assert sorted(got) == sorted(f"question number {i}?" for i in range(25, 40))
    assert not {study.prompt_digest(x) for x in got} & trained
    # without the exclusion the trained prompts come back (the check above can fail)
    assert len(study.sharegpt_prompts(str(p), 100)) == 40


def test_a_chat_rows_first_user_turn_is_its_prompt():
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    sharegpt = {"conversations": [{"from": "gpt", "value": "g"}, {"from": "human", "value": "h"}]}
    assert study.first_user_turn(chat) == "u" and study.first_user_turn(sharegpt) == "h"
    assert study.first_user_turn({}) is None
