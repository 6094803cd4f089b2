"""``make fuzz``'s verdict (the run is outside ``make test``; its judgement is held here).

The committed result's verdict follows from its own record, and each condition is seen failing
on a record that breaks it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from bench.long_checks.fuzz_sidecar import verdict

RESULT = Path(__file__).resolve().parents[3] / "bench" / "results" / "fuzz_sidecar.json"
WHOLE = "token-less JSON body of 14 MB (sent whole)"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(RESULT.read_text())


def test_the_committed_verdict_follows_from_its_record(committed):
    ok, slow_ok = verdict(committed)
    assert ("pass" if ok else "fail") == committed["verdict"]
    assert slow_ok == committed["tokenless_and_slow_as_expected"]


def _broken(doc: dict, path: tuple, value) -> dict:  # noqa: ANN001
    d = copy.deepcopy(doc)
    at = d
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return d


@pytest.mark.parametrize(("path", "value"), [
    (("answers_500_or_more",), 1),
    (("unanswered",), 2),
    (("connections_left_open",), 1),
    (("sidecar_alive_at_end",), False),
    (("tracebacks_in_log",), 1),
    (("hostile", "non_finite_echoed"), 1),
    (("tokenless_and_slow_bodies", "tokenless_uploads", "answers"), {"401": 3, "200": 1}),
    (("tokenless_and_slow_bodies", "stalled_bodies", "answers"), {"408": 3, "200": 1}),
    (("tokenless_and_slow_bodies", "stalled_bodies", "over_the_per_client_limit"), 200),
    (("answers_by_kind_and_status", WHOLE), {"401": 80, "413": 1}),
    (("answers_by_kind_and_status", WHOLE), {}),
])  # fmt: skip
def test_each_condition_fails_the_verdict(committed, path, value):
    assert verdict(committed)[0], "the committed run must pass for this test to mean anything"
    assert not verdict(_broken(committed, path, value))[0], path
