"""The development stack: vLLM (with our connector) and the sidecar as real child processes on
private paths and free ports, stopped together, spool removed.

What ``make demo``, the integration tests and the benchmarks start; nothing of the product but
the demo imports it (``tests/unit/project/test_import_boundaries.py``): operators run ``hsstream up`` or
compose, which this wraps (:class:`hsstream.up.Supervisor`), so the harness starts the stack
exactly as users do and adds only the choice of paths and ports.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from hsstream import launch
from hsstream.up import Supervisor, UpConfig, hsstream_vllm_cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (engines listen on port, port + 1, ...)."""
    if n == 1:
        return free_port()
    for _ in range(100):
        first = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def stack_token(env: dict[str, str], run_dir: Path, *, started: bool) -> str:
    """A stack's bearer token: ``HSSTREAM_API_TOKEN`` of its ``env``, else the one its sidecar
    wrote in ``run_dir``. Before the stack has ``started`` there is none to read: a client made
    then would send no token and get 401 from the stack it was made for (``make soak`` did, once),
    so that is an error, not an empty token."""
    from connector.contract.api_token import client_token

    token = client_token(env.get("HSSTREAM_API_TOKEN"), run_dir)
    if not token and not started:
        raise RuntimeError("the stack's token is made by its sidecar: ask for it (client(), headers, "
                           "client_env()) after start(), or set HSSTREAM_API_TOKEN in its env")
    return token


class Stack:
    """vLLM + sidecar as child processes, stopped together, spool removed.

    A thin front over :class:`hsstream.up.Supervisor` (what ``hsstream up`` runs), so the demo
    and the tests start the stack exactly as users do; this class only picks private paths and
    free ports. ``env`` may be changed before :meth:`start`; ``children`` may be replaced by
    tests that kill and restart a process themselves (``stop`` stops whatever is listed).
    """

    def __init__(
        self, model: str, layer_ids: list[int], workdir: Path, *, prefix_caching: bool = False,
        max_model_len: int = 1024, gpu_memory_utilization: float | None = None, vllm_extra: list[str] | None = None,
        vllm_gpus: str | None = None, engines: int = 1, base_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.layer_ids = layer_ids
        self.workdir = workdir
        self.spool = Path(tempfile.mkdtemp(prefix="hsstream-", dir="/dev/shm"))
        self.run_dir = Path(tempfile.mkdtemp(prefix="hsstream-run-"))
        self.engines = engines
        self.vllm_port, self.api_port = free_ports(engines), free_port()
        self.env = {
            "HSSTREAM_SPOOL_DIR": str(self.spool),
            "HSSTREAM_RUN_DIR": str(self.run_dir),
            "HSSTREAM_VLLM_URL": ",".join(f"http://127.0.0.1:{self.vllm_port + i}" for i in range(engines)),
            "HSSTREAM_MODEL": model,
            "HSSTREAM_LAYER_IDS": ",".join(map(str, layer_ids)),
            "HSSTREAM_PORT": str(self.api_port),
            "PYTHONUNBUFFERED": "1",
        }
        self.prefix_caching = prefix_caching
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.vllm_extra = list(vllm_extra or [])  # more vLLM flags (benchmarks: --load-format dummy, TP)
        self.vllm_gpus = vllm_gpus  # CUDA_VISIBLE_DEVICES of vLLM
        self.base_env = base_env  # the children's starting environment (UpConfig.base_env); None: this process's
        self.children: list[launch.Child] = []
        self._sup: Supervisor | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def token(self) -> str:
        """The REST API's bearer token: ``HSSTREAM_API_TOKEN`` of the stack's environment, else the
        one its sidecar made in the stack's run dir (``connector/contract/api_token.py``)."""
        return stack_token(self.env, self.run_dir, started=self._sup is not None)

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header for a plain HTTP call to :attr:`api`."""
        from connector.contract.rest_client import auth_headers

        return auth_headers(self.token)

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with this stack's token in
        ``HSSTREAM_API_TOKEN``: for a client command run as a child (``hsstream train --api ...``),
        which would otherwise look for a token in the default run dir, not this stack's."""
        return {**(os.environ if base is None else base), "HSSTREAM_API_TOKEN": self.token}

    def client(self, **kw):  # noqa: ANN003, ANN201 - a SidecarClient (imported here: httpx)
        """The typed REST client of this stack's sidecar, with its token."""
        from connector.contract.rest_client import SidecarClient

        return SidecarClient(self.api, token=self.token, **kw)

    @property
    def delivery_endpoint(self) -> str:
        return f"ipc://{self.run_dir}/delivery.sock"

    def start(self, on_tick=None) -> None:  # noqa: ANN001
        cli = hsstream_vllm_cli(
            self.model, self.layer_ids, "127.0.0.1", self.vllm_port, max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization or (0.2 if launch.is_cpu_build() else None),
            enforce_eager=True, prefix_caching=self.prefix_caching,
            extra=["--served-model-name", "verifier", *self.vllm_extra],
        )  # fmt: skip
        cfg = UpConfig(
            model=self.model, layer_ids=self.layer_ids, spool_dir=self.spool, run_dir=self.run_dir,
            api_host="127.0.0.1", api_port=self.api_port, vllm_host="127.0.0.1", vllm_port=self.vllm_port,
            vllm_cli=cli, env=self.env, max_restarts=0, ready_timeout_s=600, log_dir=self.workdir,
            cwd=launch.repo_root(), vllm_gpus=self.vllm_gpus, engines=self.engines, base_env=self.base_env,
        )  # fmt: skip
        self._sup = Supervisor(cfg, echo=False)
        self._sup.children = self.children
        self._sup.start(on_tick)

    def stop(self) -> None:
        if self._sup is not None:
            self._sup.stop()
        for c in self.children:  # never started through the supervisor, or added later
            c.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def spool_files(self) -> list[str]:
        """Everything in the spool but the sidecar's ownership marker, its lock and the arena file
        (whose slots :meth:`held_slots` counts)."""
        from connector.contract.spool import KEPT_NAMES

        return sorted(n for n in os.listdir(self.spool) if n not in KEPT_NAMES) if self.spool.exists() else []

    def held_slots(self) -> int:
        """Slots samples hold in the sidecar's arena (0 with files, or when it does not answer)."""
        from connector.contract.rest_client import SidecarClient, SidecarError

        try:
            with SidecarClient(self.api, token=self.token, timeout=10) as c:
                a = c.stats().arena
        except SidecarError:
            return 0
        return a.slots if a is not None else 0

    def remove_spool(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)
