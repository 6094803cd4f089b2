"""``hsstream up``: the whole stack (vLLM + sidecar [+ trainer]) as supervised local processes.

Compose is the deployment on a GPU host; this is the same stack where there is no container
engine (a laptop, CI, a GPU box without Docker). It reads the same settings as compose (the
``HSSTREAM_*`` variables and, with ``--env-file``, compose's ``.env``) and starts vLLM
through ``hsstream vllm``, the very command compose's vLLM service runs, so the vLLM
command line is built in one place (:func:`hsstream.launch.vllm_args`) whichever way the
stack is started.

Where each part is (this module only re-exports them, so ``from hsstream.up import X`` is
the one import callers need):

================================  ===========================================================
``config.py``                     ``UpConfig`` and ``build_config`` (flags > environment >
                                  ``.env`` > defaults), ``read_env_file``,
                                  ``hsstream_vllm_cli``, engine names, ``split_cores``,
                                  ``UpError`` (what a user fixes before anything starts)
``children.py``                   ``Proc`` (a child whose output is streamed and kept), the
                                  parent-death signal, ``describe_exit``, ``reap_group``
``shm_cleanup.py``                the /dev/shm files a killed vLLM group leaves:
                                  ``shm_snapshot``, ``group_shm_files``, ``remove_shm_files``,
                                  ``live_shm_inodes``
``ports.py``                      ``port_in_use``: the check before anything binds
``log_noise.py``                  vLLM's and triton's harmless messages and the one line shown
                                  for each
``supervisor.py``                 ``Supervisor``: start, watch, restart, stop and clean up
================================  ===========================================================

Only ``supervisor.py`` imports the others; none of them imports it
(``tests/unit/project/test_import_boundaries.py``). The demo and the integration tests use
:class:`Supervisor` in-process (``hsstream.devstack.Stack``).
"""

# The modules the parts call through (``launch.num_hidden_layers``, ``os.sched_getaffinity``,
# ``subprocess.Popen``) stay reachable here: unit tests replace those functions through
# ``hsstream.up``, and the replacement is what every part then calls.
import os
import subprocess

from hsstream import launch
from hsstream.up.children import Proc, describe_exit, reap_group
from hsstream.up.config import (
    UpConfig,
    UpError,
    build_config,
    engine_name,
    hsstream_vllm_cli,
    is_engine,
    read_env_file,
    split_cores,
)
from hsstream.up.log_noise import (
    NANOBIND_EXIT_REPORT,
    NANOBIND_EXPLAINED,
    VLLM_SLOW_WORKERS,
    VLLM_SLOW_WORKERS_EXPLAINED,
    VLLM_STOP_NOISE,
    VLLM_STOP_RACE,
    VLLM_STOP_RACE_EXPLAINED,
)
from hsstream.up.ports import port_in_use
from hsstream.up.shm_cleanup import group_shm_files, live_shm_inodes, remove_shm_files, shm_snapshot
from hsstream.up.supervisor import STOP_ORDER, Supervisor

__all__ = [
    "NANOBIND_EXIT_REPORT",
    "NANOBIND_EXPLAINED",
    "STOP_ORDER",
    "VLLM_SLOW_WORKERS",
    "VLLM_SLOW_WORKERS_EXPLAINED",
    "VLLM_STOP_NOISE",
    "VLLM_STOP_RACE",
    "VLLM_STOP_RACE_EXPLAINED",
    "Proc",
    "Supervisor",
    "UpConfig",
    "UpError",
    "build_config",
    "describe_exit",
    "engine_name",
    "group_shm_files",
    "hsstream_vllm_cli",
    "is_engine",
    "launch",
    "live_shm_inodes",
    "os",
    "port_in_use",
    "read_env_file",
    "reap_group",
    "remove_shm_files",
    "shm_snapshot",
    "split_cores",
    "subprocess",
]
