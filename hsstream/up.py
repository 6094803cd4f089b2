"""``hsstream up``: the whole stack (vLLM + sidecar [+ trainer]) as supervised local processes.

Compose is the deployment on a GPU host; this is the same stack where there is no container
engine (a laptop, CI, a GPU box without Docker). It reads the same settings as compose (the
``HSSTREAM_*`` variables and, with ``--env-file``, compose's ``.env``) and starts vLLM
through ``hsstream vllm``, the very command compose's vLLM service runs, so the vLLM
command line is built in one place (:func:`hsstream.launch.vllm_args`) whichever way the
stack is started.

Why a supervisor rather than three background commands:

- every child runs in its own process group and is stopped as a group, so vLLM's engine and
  worker processes go with it (a plain kill of the API server leaves them holding memory);
- vLLM or the sidecar dying is survivable (the sidecar resubmits what was in flight, its
  ledger is on disk), but only if something restarts them; compose's restart policy does that
  in containers, :class:`Supervisor` here;
- the spool is shared memory: files left behind by a stopped stack hold RAM until reboot, so
  stopping removes every spool file the stack wrote, and a signal never skips that.

The demo and the integration tests use :class:`Supervisor` in-process (``hsstream.demo.Stack``).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from urllib.parse import urlsplit

from connector import protocol as P
from hsstream import launch

#: Keys of compose's ``.env`` that are not ``HSSTREAM_*`` settings but mean the same thing for
#: a local stack (see deploy/.env.example), so one file configures both.
DEPLOY_KEYS = (
    "MODEL_DIR",
    "VLLM_PORT",
    "MAX_MODEL_LEN",
    "GPU_MEMORY_UTILIZATION",
    "TENSOR_PARALLEL_SIZE",
    "DATA_PARALLEL_SIZE",
    "VLLM_GPUS",
    "TRAINER_GPUS",
)

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

#: Order in which children are stopped: the trainer first (it returns its leases while the
#: sidecar still listens), vLLM next (no new files), the sidecar last (it deletes the files of
#: notices still arriving).
STOP_ORDER = ("trainer", "vllm", "sidecar")


class UpError(RuntimeError):
    """A problem a user can fix before anything starts (port taken, bad layer ids, ...)."""


class _Interrupted(Exception):
    """A stop was requested (signal) while waiting for readiness."""


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class UpConfig:
    model: str
    layer_ids: list[int]
    spool_dir: Path
    run_dir: Path
    api_host: str
    api_port: int
    vllm_host: str
    vllm_port: int
    #: Arguments after ``hsstream vllm`` (our options, then ``--`` and vLLM's own).
    vllm_cli: list[str]
    #: Variables the children get on top of this process's environment.
    env: dict[str, str] = field(default_factory=dict)
    vllm_gpus: str | None = None
    trainer_gpus: str | None = None
    trainer_cmd: list[str] | None = None
    max_restarts: int = 3
    ready_timeout_s: float = 900.0
    log_dir: Path | None = None
    cwd: str | None = None
    #: vLLM engines (processes) feeding the sidecar, on ports vllm_port, vllm_port + 1, ...
    engines: int = 1

    @property
    def api_url(self) -> str:
        return f"http://{_url_host(self.api_host)}:{self.api_port}"

    @property
    def vllm_url(self) -> str:
        return self.engine_url(0)

    def engine_url(self, i: int) -> str:
        return f"http://{_url_host(self.vllm_host)}:{self.vllm_port + i}"

    def engine_cli(self, i: int) -> list[str]:
        """``vllm_cli`` with engine ``i``'s port (our options come before any ``--``)."""
        cli = list(self.vllm_cli)
        end = cli.index("--") if "--" in cli else len(cli)
        j = cli.index("--port", 0, end)
        cli[j + 1] = str(self.vllm_port + i)
        return cli


def engine_name(i: int) -> str:
    """The child's name: "vllm" for the first engine (as with one), "vllm-2", ... for the others."""
    return "vllm" if i == 0 else f"vllm-{i + 1}"


def is_engine(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm-")


def split_cores(cores: list[int], parts: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each of ``parts`` CPU engines: the cores split evenly, so
    engines never share a core (OpenMP threads spinning on one core halve both)."""
    if len(cores) < parts:
        raise UpError(f"{parts} CPU engines need at least {parts} cores; this process may use {len(cores)}")
    per = len(cores) // parts
    groups = [cores[i * per : (i + 1) * per] for i in range(parts)]
    return [f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups]


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Compose's ``.env`` semantics: the shell's environment wins over the file.

    A relative ``MODEL_DIR`` is relative to the file's folder, as compose resolves bind
    mounts against the project folder, so ``deploy/.env`` means the same to both.
    """
    from dotenv import dotenv_values

    p = Path(path)
    if not p.is_file():
        raise UpError(f"env file {p} not found (copy deploy/.env.example to start one)")
    out = {k: v for k, v in dotenv_values(p).items() if v is not None and k not in os.environ}
    if out.get("MODEL_DIR") and not os.path.isabs(out["MODEL_DIR"]):
        out["MODEL_DIR"] = str((p.parent / out["MODEL_DIR"]).resolve())
    return out


def hsstream_vllm_cli(
    model: str,
    layer_ids: list[int],
    host: str,
    port: int,
    *,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    enforce_eager: bool = False,
    prefix_caching: bool = False,
    extra: list[str] | None = None,
) -> list[str]:
    """Arguments for ``hsstream vllm``: only its options, so the vLLM command is built there."""
    cli = ["--model", model, "--layer-ids", ",".join(map(str, layer_ids)), "--host", host, "--port", str(port)]
    if max_model_len:
        cli += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization:
        cli += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if enforce_eager:
        cli.append("--enforce-eager")
    if prefix_caching:
        cli.append("--prefix-caching")
    if extra:
        cli += ["--", *extra]
    return cli


def build_config(
    *,
    env_file: str | None = None,
    model: str | None = None,
    layer_ids: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    enforce_eager: bool | None = None,
    prefix_caching: bool = False,
    vllm_extra: list[str] | None = None,
    trainer_cmd: list[str] | None = None,
    max_restarts: int = 3,
    ready_timeout_s: float = 900.0,
    log_dir: str | None = None,
    engines: int = 1,
    say: Callable[[str], None] = lambda _m: None,
) -> UpConfig:
    """Resolve the stack's configuration: CLI flags > environment > ``.env`` > defaults."""
    from connector.layers import LayerIdError, validate_layer_ids
    from connector.contract.settings import Settings

    filed = read_env_file(env_file) if env_file else {}
    env = {**filed, **os.environ}

    def get(key: str) -> str | None:
        v = env.get(key)
        return v if v not in (None, "") else None

    def number(key: str, kind: type[int] | type[float]) -> int | float | None:
        v = get(key)
        try:
            return kind(v) if v is not None else None
        except ValueError:
            raise UpError(f"{key}={v!r} is not a{'n integer' if kind is int else ' number'}") from None

    from pydantic import ValidationError

    try:
        s = Settings(**{k[len("HSSTREAM_") :].lower(): v for k, v in filed.items() if k.startswith("HSSTREAM_")})
    except ValidationError as e:
        raise UpError(f"invalid HSSTREAM_* setting: {e}") from None
    from hsstream.exposure import OpenBindRefused, check_api_exposure

    try:  # the sidecar would refuse this bind itself, after vLLM had loaded for a minute
        if warning := check_api_exposure(s.host, s.api_token, s.allow_open):
            say(warning)
    except OpenBindRefused as e:
        raise UpError(str(e)) from None

    mdl = model or s.model or get("MODEL_DIR")
    if mdl and (mdl == get("MODEL_DIR") or os.path.isabs(mdl) or mdl.startswith(".")) and not os.path.isdir(mdl):
        # a path, not a hub name: say so now rather than after vLLM has started and failed
        raise UpError(f"model folder {mdl} does not exist (--model, HSSTREAM_MODEL or MODEL_DIR)")
    if not mdl:
        from hsstream.tiny_model import build_tiny_verifier

        say("no model configured (--model, HSSTREAM_MODEL or MODEL_DIR): using the tiny test verifier")
        mdl = str(build_tiny_verifier())
    n = launch.num_hidden_layers(mdl)
    if layer_ids:
        try:
            ids = [int(x) for x in layer_ids.replace(",", " ").split()]
        except ValueError as e:
            raise UpError(f"--layer-ids {layer_ids!r}: not a list of integers") from e
    elif s.layer_ids:
        ids = list(s.layer_ids)
    elif n is not None:
        ids = launch.default_layer_ids(n)
    else:
        raise UpError(f"no layer ids (--layer-ids or HSSTREAM_LAYER_IDS) and no {mdl}/config.json to choose from")
    try:
        ids = validate_layer_ids(ids, n)
    except LayerIdError as e:
        raise UpError(str(e)) from e

    if engines < 1:
        raise UpError(f"--engines {engines}: at least one vLLM engine is needed")
    if "," in s.vllm_url:
        raise UpError(f"HSSTREAM_VLLM_URL={s.vllm_url!r} lists several engines: `hsstream up` starts its own "
                      "(give one URL for the first engine's host and port, and --engines N)")  # fmt: skip
    vu = urlsplit(s.vllm_url)
    vllm_host = vu.hostname or "127.0.0.1"
    vllm_port = vu.port or 8000
    if "HSSTREAM_VLLM_URL" not in env and get("VLLM_PORT"):
        vllm_port = int(number("VLLM_PORT", int))  # type: ignore[arg-type]
    cpu = launch.is_cpu_build()
    if gpu_memory_utilization is None:
        gpu_memory_utilization = number("GPU_MEMORY_UTILIZATION", float)  # type: ignore[assignment]
    if gpu_memory_utilization is None and cpu:
        gpu_memory_utilization = 0.2  # on the CPU build this sizes the KV cache in host RAM
    if max_model_len is None:
        max_model_len = number("MAX_MODEL_LEN", int)  # type: ignore[assignment]  # 0: the model's own
    if enforce_eager is None:
        enforce_eager = cpu  # compiling takes minutes on a CPU and buys nothing for prefill-only work

    passthrough = []
    for key in ("TENSOR_PARALLEL_SIZE", "DATA_PARALLEL_SIZE"):
        flag = "--" + key.lower().replace("_", "-")
        if (size := number(key, int)) and size != 1:
            passthrough += [flag, str(size)]
    cli = hsstream_vllm_cli(
        mdl, ids, vllm_host, vllm_port, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager, prefix_caching=prefix_caching, extra=passthrough + list(vllm_extra or []),
    )  # fmt: skip

    child_env = dict(filed)
    child_env.update({
        "HSSTREAM_MODEL": mdl,
        "HSSTREAM_LAYER_IDS": ",".join(map(str, ids)),
        "HSSTREAM_SPOOL_DIR": str(s.spool_dir),
        "HSSTREAM_RUN_DIR": str(s.run_dir),
        "HSSTREAM_LEDGER_PATH": str(s.ledger_file()),  # given a run dir, the sidecar would put it there
        "HSSTREAM_VLLM_URL": ",".join(f"http://{_url_host(vllm_host)}:{vllm_port + i}" for i in range(engines)),
        "HSSTREAM_HOST": s.host,
        "HSSTREAM_PORT": str(s.port),
        "PYTHONUNBUFFERED": "1",  # logs are streamed line by line
    })  # fmt: skip
    return UpConfig(
        model=mdl,
        layer_ids=ids,
        spool_dir=Path(s.spool_dir),
        run_dir=Path(s.run_dir),
        api_host=s.host,
        api_port=s.port,
        vllm_host=vllm_host,
        vllm_port=vllm_port,
        vllm_cli=cli,
        env=child_env,
        vllm_gpus=get("VLLM_GPUS"),
        trainer_gpus=get("TRAINER_GPUS"),
        trainer_cmd=trainer_cmd,
        max_restarts=max_restarts,
        ready_timeout_s=ready_timeout_s,
        log_dir=Path(log_dir) if log_dir else None,
        engines=engines,
    )


# --------------------------------------------------------------------------------------------
# Children
# --------------------------------------------------------------------------------------------


def _pdeathsig() -> Callable[[], None] | None:
    """preexec_fn: the child gets SIGTERM if ``up`` itself is killed (-9), so no orphan vLLM.

    Resolved before any fork: the child only makes one system call.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1

    def _set() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return _set if sys.platform.startswith("linux") else None


_PREEXEC = _pdeathsig()


class Proc(launch.Child):
    """A child whose output is streamed (prefixed) and kept: the last lines explain a death."""

    def __init__(
        self, name: str, proc: subprocess.Popen, log_path: Path | None, sink: Callable[[str, str], None] | None
    ) -> None:
        super().__init__(name, proc, log_path)
        self.lines: deque[str] = deque(maxlen=60)
        self.started = time.monotonic()
        self._sink = sink
        self._reader = threading.Thread(target=self._pump, name=f"up-log-{name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        out = open(self.log_path, "a", encoding="utf-8") if self.log_path else None  # noqa: SIM115
        try:
            assert self.proc.stdout is not None
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.lines.append(line)
                if out:
                    out.write(line + "\n")
                    out.flush()
                if self._sink:
                    self._sink(self.name, line)
        except (OSError, ValueError):
            pass
        finally:
            if out:
                out.close()

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def join_reader(self, timeout: float = 5.0) -> None:
        self._reader.join(timeout)
        if self.proc.stdout:
            self.proc.stdout.close()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _reap_group(pgid: int, grace_s: float = 10.0) -> None:
    """Stop what is left of a process group whose leader is gone: SIGTERM, a grace period, SIGKILL.

    vLLM's engine, workers and multiprocessing resource tracker outlive a killed API server.
    SIGTERM first, because the tracker unlinks the named semaphores and shared memory it
    tracks only if it is not killed itself (it ignores SIGTERM and exits once the others did).
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.1)


def shm_snapshot() -> dict[str, int]:
    """The plain files in /dev/shm now, by path with their inode: taken before an engine starts,
    so that what was there already (same name and inode) is never counted as the engine's."""
    out: dict[str, int] = {}
    try:
        for e in os.scandir("/dev/shm"):
            try:
                if e.is_file(follow_symlinks=False):
                    out[e.path] = e.inode()
            except OSError:
                continue
    except OSError:
        pass
    return out


def _maps_of(pid: str) -> list[tuple[int, str]]:
    """(inode, path) of each /dev/shm file mapped by process ``pid`` (empty if unreadable)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            i = line.find("/dev/shm/")
            if i >= 0:
                path = line[i:].strip().removesuffix(" (deleted)")
                if os.path.dirname(path) == "/dev/shm":
                    out.append((int(line.split()[4]), path))
    return out


def group_shm_files(pgid: int, existing: dict[str, int] | None = None) -> set[str]:
    """The /dev/shm files a process group made and has mapped (vLLM's queues between its
    processes, torch's shared tensors).

    vLLM removes them when it exits normally; after a SIGKILL or an OOM kill they stay, a few
    hundred MB of RAM each time. Recorded while the group lives, removed once it is gone, so
    only files that are provably the group's count: mapped by one of its processes, not in
    ``existing`` (``shm_snapshot()`` taken before it started: a file that was there is
    someone else's, which vLLM only mapped), plain files owned by this user. Removal checks
    again that no live process maps them (``remove_shm_files``).
    """
    existing = existing or {}
    uid = os.geteuid()
    out: set[str] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:  # fields after comm: state ppid pgrp
                continue
            for inode, path in _maps_of(d):
                if existing.get(path) == inode or path in out:
                    continue
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if S_ISREG(st.st_mode) and st.st_uid == uid and st.st_ino == inode:
                    out.add(path)
        except (OSError, ValueError, IndexError):
            continue
    return out


def remove_shm_files(paths: set[str]) -> tuple[list[str], list[str]]:
    """Remove the recorded files of a dead group (``group_shm_files``) that no live process
    maps: (removed, kept because mapped). A file a process still maps is in use, whoever made it."""
    live: set[str] = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                live.update(path for _inode, path in _maps_of(d))
            except (OSError, ValueError, IndexError):
                continue
    removed, kept = [], []
    for path in sorted(paths):
        if path in live:
            kept.append(path)
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # vLLM removed it itself
            pass
    return removed, kept


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "in use"
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# --------------------------------------------------------------------------------------------
# The supervisor
# --------------------------------------------------------------------------------------------


class Supervisor:
    """Starts, watches and stops the stack. ``run()`` is the CLI; ``start``/``stop`` the library."""

    def __init__(
        self,
        cfg: UpConfig,
        *,
        echo: bool = True,
        say: Callable[[str], None] | None = None,
        out=None,  # noqa: ANN001 - a text stream for the children's prefixed logs
    ) -> None:
        self.cfg = cfg
        self.children: list[launch.Child] = []
        self.restarts = 0  # vLLM engines' restarts, all together
        self.sidecar_restarts = 0  # counted apart: each may use --max-restarts
        self._out = out or sys.stdout
        self._echo = echo
        self._say = say if say is not None else ((lambda m: self._emit("up", m)) if echo else (lambda _m: None))
        self._lock = threading.Lock()
        self._color = echo and hasattr(self._out, "isatty") and self._out.isatty()
        self._signal: int | None = None
        self._lock_fd: int | None = None
        self._made_spool = False
        self._vllm_shm: dict[str, set[str]] = {}  # engine name -> its shared-memory files
        self._shm_before: dict[str, dict[str, int]] = {}  # engine name -> /dev/shm before it started
        self._stopped = False
        self._nanobind_told: set[str] = set()
        self._stopping: set[str] = set()  # children we are stopping now (their exit noise is ours)
        self._noise_told: set[tuple[str, str]] = set()  # (engine, explanation) told once

    # ---------------------------------------------------------------- output
    _COLORS = {"up": "1", "vllm": "36", "sidecar": "35", "trainer": "33"}

    def _emit(self, name: str, line: str) -> None:
        if NANOBIND_EXIT_REPORT.match(line):  # kept whole in the child's log; one line here
            if name in self._nanobind_told:
                return
            self._nanobind_told.add(name)
            line = NANOBIND_EXPLAINED
        elif name in self._stopping and is_engine(name):
            told = next((why for pattern, why in VLLM_STOP_NOISE if pattern.search(line)), None)
            if told is not None:
                if (name, told) in self._noise_told:
                    return
                self._noise_told.add((name, told))
                line = told
        tag = f"{name:<7} |"
        if self._color:
            tag = f"\x1b[{self._COLORS.get(name, '0')}m{tag}\x1b[0m"
        with self._lock:
            try:
                self._out.write(f"{tag} {line}\n")
                self._out.flush()
            except (OSError, ValueError):
                pass

    def say(self, msg: str) -> None:
        self._say(msg)

    # ---------------------------------------------------------------- children
    def child(self, name: str) -> launch.Child | None:
        return next((c for c in self.children if c.name == name), None)

    def _spawn(self, name: str, args: list[str], gpus: str | None = None, extra_env: dict | None = None) -> Proc:
        env = launch.child_env(self.cfg.env)
        env.update(extra_env or {})
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        log = self.cfg.log_dir / f"{name}.log" if self.cfg.log_dir else None
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped as a whole
            cwd=self.cfg.cwd or os.getcwd(),
            preexec_fn=_PREEXEC,  # noqa: PLW1509
        )
        p = Proc(name, proc, log, self._emit if self._echo else None)
        old = self.child(name)
        if old is not None:
            self.children[self.children.index(old)] = p
        else:
            self.children.append(p)
        self.say(f"started {name} (pid {proc.pid}): {shlex.join(args[:6])}{' …' if len(args) > 6 else ''}")
        return p

    def _spawn_vllm(self, i: int = 0) -> Proc:
        # The same entry point compose's vLLM service runs: it builds the command and execs vLLM.
        c = self.cfg
        gpus, extra = c.vllm_gpus, {}
        if c.engines > 1:
            if gpus:  # one share of the listed GPUs each
                ids = [g for g in gpus.split(",") if g.strip()]
                per = max(1, len(ids) // c.engines)
                gpus = ",".join(ids[i * per : (i + 1) * per]) or None
            if launch.is_cpu_build() and "VLLM_CPU_OMP_THREADS_BIND" not in c.env:
                extra["VLLM_CPU_OMP_THREADS_BIND"] = split_cores(sorted(os.sched_getaffinity(0)), c.engines)[i]
        args = [sys.executable, "-m", "hsstream", "vllm", *c.engine_cli(i)]
        self._shm_before[engine_name(i)] = shm_snapshot()  # what is there is not this engine's to remove
        return self._spawn(engine_name(i), args, gpus, extra)

    def _ticker(
        self, what: str, on_tick: Callable[[float], None] | None, restarting: str = ""
    ) -> Callable[[float], None]:
        """Progress every 10 s while waiting, and a way out: a signal or another child dying
        (but an engine, or the child being restarted, whose death ``wait_http`` reports itself)."""
        last = [0.0]

        def tick(elapsed: float) -> None:
            if self._signal is not None:
                raise _Interrupted
            for c in self.children:
                if not is_engine(c.name) and c.name != restarting and not c.alive():
                    raise launch.ProcessDied(
                        f"{c.name} exited ({describe_exit(c.proc.returncode)}) while waiting for {what}:\n{c.tail()}"
                    )
            if on_tick:
                on_tick(elapsed)
            if elapsed - last[0] >= 10:
                last[0] = elapsed
                self.say(f"waiting for {what}: {elapsed:.0f} s")

        return tick

    # ---------------------------------------------------------------- start
    def _prepare(self) -> None:
        c = self.cfg
        for host, port, what, var in (
            (c.api_host, c.api_port, "the sidecar", "HSSTREAM_PORT"),
            *((c.vllm_host, c.vllm_port + i, engine_name(i), "VLLM_PORT or HSSTREAM_VLLM_URL") for i in range(c.engines)),
        ):
            if _port_in_use(host, port):
                raise UpError(
                    f"port {port} on {host} (for {what}) is already in use: is another stack running? (set {var})"
                )
        c.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if c.log_dir:
            c.log_dir.mkdir(parents=True, exist_ok=True)
        lock_path = c.run_dir / "up.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UpError(
                f"another `hsstream up` (pid {holder}) uses run dir {c.run_dir}; its sockets would be taken over "
                "(set HSSTREAM_RUN_DIR and HSSTREAM_SPOOL_DIR for a second stack)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        existed = c.spool_dir.exists()
        try:
            P.claim_spool(c.spool_dir)  # a folder we did not make (no marker, not empty) is refused
        except P.SpoolNotOurs as e:
            raise UpError(str(e)) from None
        self._made_spool = not existed
        if stale := self._spool_entries():
            self.say(f"spool {c.spool_dir} holds {len(stale)} file(s) from an earlier run; the sidecar reaps them")

    def start(self, on_tick: Callable[[float], None] | None = None) -> None:
        """Start everything and return when the stack answers; raise (with the log) if not."""
        c = self.cfg
        t0 = time.monotonic()
        self._prepare()
        sidecar = self._spawn_sidecar()
        engines = [self._spawn_vllm(i) for i in range(c.engines)]  # they load side by side
        launch.wait_http(f"{c.api_url}/healthz", sidecar, 120, self._ticker("the sidecar", None))
        for i, vllm in enumerate(engines):
            tick = self._ticker("vLLM to load the model", on_tick)
            launch.wait_http(f"{c.engine_url(i)}/health", vllm, c.ready_timeout_s, tick)
            self._vllm_shm[vllm.name] = group_shm_files(vllm.proc.pid, self._shm_before.get(vllm.name))
            self.say(f"{vllm.name} ready after {time.monotonic() - t0:.0f} s")
        launch.wait_http(f"{c.api_url}/readyz", sidecar, 120, self._ticker("the sidecar to reach vLLM", None))
        if c.trainer_cmd:
            self._spawn("trainer", list(c.trainer_cmd), c.trainer_gpus)
        self.say(
            f"stack ready after {time.monotonic() - t0:.0f} s: jobs to {c.api_url}/v1/jobs, "
            f"trainers connect to {c.env.get('HSSTREAM_DELIVERY_ENDPOINT') or f'ipc://{c.run_dir}/delivery.sock'}, "
            f"spool {c.spool_dir}"
        )

    # ---------------------------------------------------------------- supervise
    def _spawn_sidecar(self) -> Proc:
        return self._spawn("sidecar", [sys.executable, "-m", "hsstream", "serve"])

    def _restart_sidecar(self, dead: launch.Child) -> bool:
        """Survivable like a dead vLLM: the ledger is on disk, so the new sidecar recovers it and
        reaps stray spool files, and trainers reconnect on its heartbeat. Its restarts are
        counted apart from the engines'."""
        c = self.cfg
        return self._restart(dead, "sidecar_restarts", self._spawn_sidecar, f"{c.api_url}/healthz", 120,
                             "the sidecar to come back", restarting="sidecar")  # fmt: skip

    def _restart_vllm(self, dead: launch.Child) -> bool:
        c = self.cfg
        name = dead.name
        i = next(j for j in range(c.engines) if engine_name(j) == name)

        def back(new: launch.Child) -> None:
            self._vllm_shm[name] = group_shm_files(new.proc.pid, self._shm_before.get(name))

        return self._restart(dead, "restarts", lambda: self._spawn_vllm(i), f"{c.engine_url(i)}/health",
                             c.ready_timeout_s, "vLLM to come back", before=lambda: self._remove_vllm_shm(name),
                             after=back)  # fmt: skip

    def _restart(self, dead: launch.Child, count: str, spawn: Callable[[], launch.Child], health: str,
                 timeout_s: float, waiting: str, *, restarting: str = "", before: Callable[[], None] | None = None,
                 after: Callable[[launch.Child], None] | None = None) -> bool:  # fmt: skip
        """Restart a dead child until ``health`` answers or the restarts counted in ``self.<count>``
        reach ``--max-restarts``; False (and why) once they are used up."""
        c = self.cfg
        name = dead.name
        while True:
            why = describe_exit(dead.proc.returncode)
            used = getattr(self, count)
            if used >= c.max_restarts:
                self.say(
                    f"{name} died ({why}) and no restart is left (--max-restarts {c.max_restarts}, "
                    f"{used} used): stopping the stack.{self._last_lines(dead)}"
                )
                return False
            used += 1
            setattr(self, count, used)
            self.say(f"{name} died ({why}): restarting it ({used}/{c.max_restarts})")
            _reap_group(dead.proc.pid)  # the leader is gone; its children (engine, workers) may not be
            if before is not None:
                before()
            t0 = time.monotonic()
            new = spawn()
            try:
                launch.wait_http(health, new, timeout_s, self._ticker(waiting, None, restarting=restarting))
            except launch.ProcessDied:
                dead = new
                continue
            if after is not None:
                after(new)
            self.say(f"{name} is back after {time.monotonic() - t0:.0f} s (restart {used}/{c.max_restarts})")
            return True

    def supervise(self) -> int:
        """Watch the children until a signal (0) or a death that cannot be repaired (1)."""
        while True:
            if self._signal is not None:
                self.say(f"{signal.Signals(self._signal).name} received: stopping the stack")
                return 0
            for ch in list(self.children):
                if ch.alive():
                    continue
                code = ch.proc.returncode
                if is_engine(ch.name):
                    if not self._restart_vllm(ch):
                        return 1
                elif ch.name == "sidecar":
                    if not self._restart_sidecar(ch):
                        return 1
                elif ch.name == "trainer" and code == 0:
                    self.say("trainer finished: stopping the stack")
                    return 0
                else:  # a failed trainer: its error is the user's to see (its run dir resumes it)
                    why = describe_exit(code)
                    self.say(f"{ch.name} exited ({why}): stopping the stack.{self._last_lines(ch)}")
                    return 1
            time.sleep(0.25)

    def _last_lines(self, ch: launch.Child) -> str:
        """The log lines that explain a death, unless they were just streamed above anyway."""
        return " See its log above." if self._echo else f" Its last lines:\n{ch.tail(20)}"

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._signal is not None:  # a second Ctrl-C: no more waiting
            for ch in self.children:
                try:
                    os.killpg(ch.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._signal = signum

    def run(self) -> int:
        """The CLI's life cycle: start, supervise, and always stop and clean up. Exit status."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            self.start()
            code = self.supervise()
        except _Interrupted:
            self.say(f"{signal.Signals(self._signal or signal.SIGTERM).name} received while starting: stopping")
            code = 0
        except (launch.ProcessDied, TimeoutError, UpError) as e:
            self.say(f"error: {e}")
            code = 1
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)
        return code

    # ---------------------------------------------------------------- stop
    def _spool_entries(self) -> list[str]:
        """The spool files ours to delete: the connector's names, in a spool with our marker."""
        try:
            return P.own_spool_entries(self.cfg.spool_dir)
        except FileNotFoundError:
            return []

    def _remove_vllm_shm(self, name: str | None = None) -> None:
        """Remove the shared memory of vLLM processes that are all gone (see group_shm_files):
        one engine's (``name``), or every engine's."""
        paths: set[str] = set()
        for n in [name] if name else list(self._vllm_shm):
            paths |= self._vllm_shm.pop(n, set())
        gone, kept = remove_shm_files(paths)
        if gone:
            self.say(f"removed {len(gone)} shared-memory file(s) a dead vLLM left: {' '.join(gone)}")
        if kept:
            self.say(f"kept {len(kept)} shared-memory file(s) a dead vLLM made that a live process maps: "
                     f"{' '.join(kept)}")

    def stop(self) -> None:
        """Stop every child (whole process groups) and remove the stack's spool files. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        order = {n: i for i, n in enumerate(STOP_ORDER)}
        for ch in sorted(self.children, key=lambda c: order.get("vllm" if is_engine(c.name) else c.name, -1)):
            if ch.alive():
                self._stopping.add(ch.name)
                self.say(f"stopped {ch.name} ({describe_exit(ch.stop())})")
        unclean = [f"{c.name} ({describe_exit(c.proc.returncode)})" for c in self.children if c.proc.returncode != 0]
        for ch in self.children:
            _reap_group(ch.proc.pid)
            if isinstance(ch, Proc):
                ch.join_reader()
        self._remove_vllm_shm()
        removed = 0
        for n in self._spool_entries():
            try:
                os.unlink(self.cfg.spool_dir / n)
                removed += 1
            except FileNotFoundError:
                pass
        if self._made_spool:  # only our marker and files were in it: anything else stays, and so does the folder
            try:
                os.unlink(self.cfg.spool_dir / P.SPOOL_MARKER)
                self.cfg.spool_dir.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                self._made_spool = False
                self.say(f"spool {self.cfg.spool_dir} holds files that are not the stack's: left in place")
        if self._lock_fd is not None:
            try:
                os.unlink(self.cfg.run_dir / "up.lock")
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None
        gone = f", spool {self.cfg.spool_dir} removed" if self._made_spool else ""
        how = f"not cleanly: {', '.join(unclean)}" if unclean else "cleanly (every child exited 0)"
        self.say(f"stopped {how}; {removed} spool file(s) removed{gone}")
