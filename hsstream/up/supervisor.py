"""The :class:`Supervisor`: starts, watches, restarts and stops the stack's children.

Why a supervisor rather than three background commands:

- every child runs in its own process group and is stopped as a group, so vLLM's engine and
  worker processes go with it (a plain kill of the API server leaves them holding memory);
- vLLM or the sidecar dying is survivable (the sidecar resubmits what was in flight, its
  ledger is on disk), but only if something restarts them; compose's restart policy does that
  in containers, :class:`Supervisor` here;
- the spool is shared memory: files left behind by a stopped stack hold RAM until reboot, so
  stopping removes every spool file the stack wrote, and a signal never skips that.

It acts on a finished :class:`~hsstream.up.config.UpConfig`; the processes, the shared-memory
cleanup, the port check and the log filters it uses are each their own module of this package.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from connector import protocol as P
from hsstream import launch
from hsstream.up.children import PREEXEC, Proc, describe_exit, reap_group
from hsstream.up.config import UpConfig, UpError, engine_name, is_engine, split_cores
from hsstream.up.log_noise import NANOBIND_EXIT_REPORT, NANOBIND_EXPLAINED, VLLM_STOP_NOISE
from hsstream.up.ports import port_in_use
from hsstream.up.shm_cleanup import group_shm_files, remove_shm_files, shm_snapshot

#: Order in which children are stopped: the trainer first (it returns its leases while the
#: sidecar still listens), vLLM next (no new files), the sidecar last (it deletes the files of
#: notices still arriving).
STOP_ORDER = ("trainer", "vllm", "sidecar")


class _Interrupted(Exception):
    """A stop was requested (signal) while waiting for readiness."""


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
        env = launch.child_env(self.cfg.env, base=self.cfg.base_env)
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
            preexec_fn=PREEXEC,  # noqa: PLW1509
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
            if port_in_use(host, port):
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
            f"stack ready after {time.monotonic() - t0:.0f} s: jobs to {c.api_url}/v1/jobs (bearer token: "
            f"`hsstream token`), "
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
            reap_group(dead.proc.pid)  # the leader is gone; its children (engine, workers) may not be
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
            reap_group(ch.proc.pid)
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
