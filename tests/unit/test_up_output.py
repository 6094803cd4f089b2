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
    assert "error" in up.VLLM_STOP_RACE_EXPLAINED  # says what vLLM logged, but no ERROR/Traceback line


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
