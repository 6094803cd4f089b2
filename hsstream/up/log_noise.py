"""What vLLM and triton print that means nothing here, and the one line ``hsstream up`` shows instead.

Kept apart from the supervisor that applies them (``Supervisor._emit``): each pattern is a
known, harmless message, matched only in the context its comment names, and the tests hold
the explanations to that (none may read like a clean stop that was not one).
"""

from __future__ import annotations

import re

#: Triton's nanobind extension lists the objects still alive when an interpreter exits (vLLM's
#: processes import triton even on CPU): two dozen lines that read like a leak on the host.
NANOBIND_EXIT_REPORT = re.compile(
    r"^(nanobind: |\s+- (leaked |\.\.\. skipped remainder)|See https://nanobind\.readthedocs)"
)
NANOBIND_EXPLAINED = (
    "(triton's nanobind listed Python objects alive at interpreter exit: its known exit message, "
    "nothing is left on the host; full text in the log)"
)
#: vLLM's API server, stopped on purpose, sometimes has its output handler wake up after the
#: engine core it just drained is gone, and logs that as an ERROR with a traceback
#: (EngineDeadError). Only while *we* stop that engine does this mean nothing.
VLLM_STOP_RACE = re.compile(r"\bERROR\b.*\[async_llm\.py:\d+\]")
VLLM_STOP_RACE_EXPLAINED = (
    "(vLLM's output handler woke after the engine core it had just drained was gone, while we "
    "stopped it: vLLM's known shutdown race, harmless here; its full text is in the log)"
)
#: On a loaded host vLLM's workers can take longer to exit than its executor's grace period;
#: the executor then sends them SIGTERM, and says so at WARNING. Only that first step, and only
#: while we stop the engine: a SIGKILL after it, or anything else, is shown as it is.
VLLM_SLOW_WORKERS = re.compile(
    r"\bWARNING\b.*\[multiproc_executor\.py:\d+\].*workers still running after grace period; sending SIGTERM"
)
VLLM_SLOW_WORKERS_EXPLAINED = (
    "(vLLM's executor asked its workers to stop again after its grace period, while we stopped it: "
    "they were slow to exit on a busy host; its full text is in the log)"
)
#: vLLM's own stop noise that is harmless while we stop that engine: pattern -> the one line shown.
VLLM_STOP_NOISE = ((VLLM_STOP_RACE, VLLM_STOP_RACE_EXPLAINED), (VLLM_SLOW_WORKERS, VLLM_SLOW_WORKERS_EXPLAINED))
