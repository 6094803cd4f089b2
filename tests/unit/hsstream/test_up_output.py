"""What ``hsstream up`` prints of its children's output: known exit noise is told once, in a
line that says why it is harmless, and only where it is harmless; everything else verbatim."""

from __future__ import annotations

import io

from hsstream import up

RACE = [
    "(APIServer pid=1) ERROR 12-01 07:04:48 [async_llm.py:906] AsyncLLM output_handler failed.",
    "(APIServer pid=1) ERROR 12-01 07:04:48 [async_llm.py:906] Traceback (most recent call last):",
    "(APIServer pid=1) ERROR 12-01 07:04:48 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
]


def _supervisor(tmp_path) -> tuple[up.Supervisor, io.StringIO]:  # noqa: ANN001
    out = io.StringIO()
    cfg = up.UpConfig.__new__(up.UpConfig)  # _emit reads nothing from the config
    return up.Supervisor(cfg, out=out), out


def test_vllms_shutdown_race_is_one_line_while_we_stop_it(tmp_path):
    sup, out = _supervisor(tmp_path)
    sup._stopping.add("vllm")
    for line in RACE:
        sup._emit("vllm", line)
    lines = out.getvalue().splitlines()
    assert lines == [f"vllm    | {up.VLLM_STOP_RACE_EXPLAINED}"]
    from tests.integration.hsstream.test_up import NOT_CLEAN

    # a clean stop holds no line with these words (issue 15): the explanations use none of them
    assert not any(w in why.lower() for _, why in up.VLLM_STOP_NOISE for w in NOT_CLEAN)


def test_the_same_lines_from_an_engine_we_did_not_stop_are_shown_whole(tmp_path):
    """An engine that dies on its own is a real failure: its traceback must reach the user."""
    sup, out = _supervisor(tmp_path)
    sup._stopping.add("vllm")  # another engine is being stopped, not this one
    for line in RACE:
        sup._emit("vllm-2", line)
    assert out.getvalue().splitlines() == [f"vllm-2  | {line}" for line in RACE]
    sup2, out2 = _supervisor(tmp_path)
    for line in RACE:  # nothing is being stopped
        sup2._emit("vllm", line)
    assert len(out2.getvalue().splitlines()) == len(RACE)


def test_other_errors_of_an_engine_we_stop_are_shown(tmp_path):
    sup, out = _supervisor(tmp_path)
    sup._stopping.add("vllm")
    line = "(EngineCore pid=2) ERROR 12-01 07:04:48 [core.py:1000] EngineCore failed to start."
    sup._emit("vllm", line)
    assert out.getvalue().splitlines() == [f"vllm    | {line}"]


def _stop_transcript(tmp_path, engine_lines: list[str], *, stopping: bool = True) -> list[str]:  # noqa: ANN001
    """What ``hsstream up`` prints from a SIGINT on, through the real Supervisor's output path."""
    sup, out = _supervisor(tmp_path)
    sup.say("SIGINT received: stopping the stack")
    if stopping:
        sup._stopping.add("vllm")
    for line in engine_lines:
        sup._emit("vllm", line)
    for name in ("trainer", "vllm", "sidecar"):
        sup.say(f"stopped {name} (exit code 0)")
    sup.say("stopped cleanly (every child exited 0); 0 spool file(s) removed")
    return out.getvalue().splitlines()


def test_the_stop_check_accepts_the_explained_race_and_refuses_the_raw_lines(tmp_path):
    """The clean-stop check of test_up and test_readme (issue 15: no warning lines, "or they are
    explained in one line") passes a stop where vLLM's shutdown race was told in its one line, and
    still fails on the race's raw lines and on any other error."""
    import pytest

    from tests.integration.hsstream.test_up import assert_stopped_cleanly

    assert_stopped_cleanly(_stop_transcript(tmp_path, RACE), "SIGINT")
    with pytest.raises(AssertionError, match="warnings in a clean stop"):  # not ours to stop: shown verbatim
        assert_stopped_cleanly(_stop_transcript(tmp_path, RACE, stopping=False), "SIGINT")
    other = "(EngineCore pid=2) ERROR 12-01 07:04:48 [core.py:1000] EngineCore failed to start."
    with pytest.raises(AssertionError, match="warnings in a clean stop"):
        assert_stopped_cleanly(_stop_transcript(tmp_path, [other]), "SIGINT")
    explained = _stop_transcript(tmp_path, RACE)
    with pytest.raises(AssertionError, match="told twice for one engine"):  # once per engine
        assert_stopped_cleanly(explained + [ln for ln in explained if up.VLLM_STOP_RACE_EXPLAINED in ln], "SIGINT")


SLOW = ("(EngineCore pid=20717) WARNING 12-01 11:24:30 [multiproc_executor.py:491] [shutdown] Executor: "
        "workers still running after grace period; sending SIGTERM count=1")
KILL = ("(EngineCore pid=20717) WARNING 12-01 11:24:40 [multiproc_executor.py:497] [shutdown] Executor: "
        "workers still running; sending SIGKILL count=1")


def test_slow_workers_at_our_stop_are_one_line_and_a_sigkill_is_shown(tmp_path):
    """Seen in make test on a loaded host: vLLM's executor re-signals slow workers at WARNING.
    Told once while we stop that engine; verbatim otherwise; a SIGKILL after it always verbatim."""
    from tests.integration.hsstream.test_up import assert_stopped_cleanly

    sup, out = _supervisor(tmp_path)
    sup._stopping.add("vllm")
    for line in (SLOW, SLOW, *RACE):
        sup._emit("vllm", line)
    assert out.getvalue().splitlines() == [f"vllm    | {up.VLLM_SLOW_WORKERS_EXPLAINED}",
                                           f"vllm    | {up.VLLM_STOP_RACE_EXPLAINED}"]  # fmt: skip
    assert_stopped_cleanly(_stop_transcript(tmp_path, [SLOW, *RACE]), "SIGINT")
    import pytest

    with pytest.raises(AssertionError, match="warnings in a clean stop"):
        assert_stopped_cleanly(_stop_transcript(tmp_path, [SLOW, KILL]), "SIGINT")
    with pytest.raises(AssertionError, match="warnings in a clean stop"):
        assert_stopped_cleanly(_stop_transcript(tmp_path, [SLOW], stopping=False), "SIGINT")
