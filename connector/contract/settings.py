"""Every ``HSSTREAM_*`` setting, in one place, for all processes.

A contract like the wire format: the connector inside vLLM, the sidecar, the trainer and the
launcher read the same names, so one ``.env`` configures a whole stack (compose or
``hsstream up``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from typing import Annotated, Literal

from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from connector.contract import endpoints as E
from connector.contract.sample_file import CONNECTOR_CHECKSUM_ALGO


def _default_run_dir() -> str:
    # The notice socket lives in a directory only our user can write (ipc:// has no auth). The
    # runtime dir may go at logout or reboot: only sockets live here, remade at each start.
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"hsstream-{os.getuid()}")


def _default_state_dir() -> str:
    # The ledger (jobs, every sample's state, the users' token ids) must outlive a reboot, as
    # the sidecar's restart promises: the XDG state directory, per user.
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "hsstream")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSSTREAM_", extra="ignore")

    # Shared by all roles
    spool_dir: Path = Path("/dev/shm/hsstream")
    run_dir: Path = Field(default_factory=lambda: Path(_default_run_dir()))  # sockets
    state_dir: Path = Field(default_factory=lambda: Path(_default_state_dir()))  # the ledger (see ledger_file)
    notice_endpoint: str = ""  # default: ipc://{run_dir}/notice.sock
    delivery_endpoint: str = ""  # default: ipc://{run_dir}/delivery.sock

    # Sidecar
    host: str = "127.0.0.1"
    port: int = 8100
    # One engine, or several separated by commas (each with our connector, the same spool and
    # notice endpoint): the sidecar sends each sample to the least-loaded engine that is up.
    vllm_url: str = "http://127.0.0.1:8000"
    model: str = ""  # verifier checkpoint dir / name (tokenizer + shapes)
    layer_ids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    max_concurrency: int = 16
    request_timeout_s: float = 600.0
    max_attempts: int = 3
    spool_budget_bytes: int = 2 * 2**30
    # How samples lie in the spool: a name in connector/layouts/'s registry, "files" (one
    # safetensors file per sample, what drop-in clients get) or "arena" (one shared-memory file
    # the size of the budget, a slot per sample: no file written, read or unlinked per sample,
    # connector/contract/arena.py). An unregistered name stops the sidecar at start-up, naming
    # the registered ones (the contracts import nothing of the layouts, so it is checked there).
    # Sidecar only: the connector and trainers follow each sample's placement (its slot or file).
    spool_layout: str = Field(default="files", pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    # Arena: seconds a slot whose sample was abandoned (timed out, its engine down, the sidecar
    # restarted, a lease cancelled) waits before it is assigned again, so a late reader's views
    # see no one else's bytes. Late writes need no wait: the slot's claim is voided first, under
    # its lock (connector/contract/arena.py).
    arena_quarantine_s: float = Field(default=60.0, ge=0)
    max_ready_samples: int = 4096  # ready-but-unconsumed samples before submission pauses
    ledger_path: Path | None = None  # default: see ledger_file()
    vllm_down_deadline_s: float = 600.0
    notice_timeout_s: float = 120.0
    trainer_timeout_s: float = 120.0  # silence after which a trainer's leases go back
    # What one trainer may hold: samples sent to it and not yet confirmed (RECEIVED/ACK/FAIL),
    # whatever credit it claims (its window is a hint), and messages waiting in ZeroMQ's queue
    # to it. A DELIVER its full queue refuses goes back to READY at once: the delivery thread
    # never waits for one trainer.
    max_trainer_credit: int = Field(default=256, ge=1, le=65536)
    trainer_send_hwm: int = Field(default=256, ge=1, le=65536)
    # What one message from a peer may cost: a larger one (a trainer's to the delivery socket, a
    # notice) drops its connection in ZeroMQ, unparsed; the jobs one trainer's HELLO may name
    # (each delivery pass walks them under the ledger's lock): more is refused with a reason.
    max_peer_message_bytes: int = Field(default=1 << 20, ge=64 << 10, le=1 << 30)
    max_hello_jobs: int = Field(default=1024, ge=1, le=100_000)
    # Keys one ACK or RECEIVED may name (the stream sends at most 1,024): a longer list is
    # refused whole and counted (server/delivery.py), since each key is checked under the
    # ledger's lock.
    max_settle_keys: int = Field(default=1024, ge=1, le=65536)
    max_body_bytes: int = 256 * 2**20  # uploads (multipart, spooled to disk as they arrive)
    max_json_bytes: int = 16 * 2**20  # JSON bodies (parsed in memory): larger jobs go to /v1/jobs/upload
    # One job's size: its samples, and its rows in the ledger (samples x epochs), each written and
    # later produced. A dataset of a million samples for a few epochs fits; more is several jobs.
    max_job_samples: int = Field(default=1_000_000, ge=1)
    max_job_rows: int = Field(default=5_000_000, ge=1)
    # REST connections (server/connections.py): a request's head must arrive within the header
    # timeout (from the connection's start, or the request's first byte), a connection idle
    # after an answer is closed after the idle timeout, and past the connection limit a new one
    # gets 503 and is closed (file descriptors for vLLM and the sidecar's files are kept back).
    http_header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    http_idle_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    http_max_connections: int = Field(default=512, ge=1, le=65536)
    # A request body must keep coming (server/body_limit.py): a wait longer than this for its
    # next piece gets 408 and the connection closed. Not a bound on the whole upload, which may
    # be long over a slow link, but on a body that stalls (held open to pin a connection).
    http_body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # Requests with a body (job submissions, uploads) one client address may have in progress at
    # once, from the first byte to the answer (server/request_gate.py): more get 429. Each holds
    # up to its body limit in memory or on disk and a place in the admission queue.
    max_uploads_per_client: int = Field(default=4, ge=1, le=4096)
    job_retention_s: float = 24 * 3600.0  # finished jobs keep their samples' rows this long, then a summary
    # Python's thread switch interval in the sidecar, in vLLM's worker where the connector writes
    # (rank 0), and in a trainer whose HiddenStateStream has check workers (0: leave Python's
    # 5 ms). A thread that passes a sample on (notices, delivery, the stream's socket thread, the
    # connector's writers beside vLLM's loop) needs the interpreter for well under a
    # millisecond, but waits up to the interval whenever another thread holds it. Never raised.
    switch_interval_ms: float = 1.0
    # Remote trainers (other hosts): TCP + CURVE. Keys in zmq.auth's certificate format
    # (`hsstream keys DIR` makes them); the sidecar accepts any public key in curve_clients_dir.
    remote_endpoint: str | None = None  # e.g. tcp://0.0.0.0:5601
    curve_server_secret_file: Path | None = None
    curve_clients_dir: Path | None = None
    api_token: str | None = None
    # How a sample's bytes reach a trainer (connector/transport/). Trainer: "spool", "zmq" or
    # "mooncake" (empty: spool for an ipc:// endpoint, zmq for tcp://). Sidecar: with
    # mooncake_hostname set it also serves "mooncake", its engine advertised at that address
    # (one the trainers' hosts reach); a trainer's own address defaults to the one on its route
    # to the sidecar. Mooncake's engines meet point to point (no metadata service).
    transport: str = ""
    # Trainer: threads a HiddenStateStream reads and checks delivered samples on (0: on the
    # iterating thread), so a burst of samples is not checked one after another.
    stream_workers: int = 4
    # Trainer: yield samples in delivery order (a checked sample waits for older ones) instead of
    # as soon as each is checked.
    stream_ordered: bool = False
    mooncake_hostname: str | None = None
    mooncake_protocol: str = "tcp"  # or "rdma" where the hosts have it (untested here)
    mooncake_device: str = ""  # RDMA device names; empty: Mooncake picks
    # Serve the REST API without a token on a non-loopback address (hsstream/exposure.py): off,
    # so an open API on the network is always something a person asked for.
    allow_open: bool = False
    # Accept a tcp:// notice or delivery endpoint, or a stream's tcp:// without CURVE keys
    # (connector/contract/endpoints.py): off, so unauthenticated sockets are always something asked for.
    allow_insecure_tcp: bool = False

    # Connector
    num_writer_threads: int = 4
    # Hidden states copied out but not yet written (host memory, pinned on CUDA). Over it a
    # request gets a "busy" notice instead of a file; the engine step never waits.
    max_pending_write_bytes: int = 2 * 2**30
    max_queued_notices: int = 4096  # notices waiting for the sidecar; older ones are useless after its restart
    # Layer order in the files: "config" (the order of layer_ids) or "sorted" (ascending, as
    # vLLM's Example connector writes; what speculators expects: it takes the last as layer N).
    layer_order: str = "config"
    # The connector's checksum, one of sample_file.CHECKSUM_ALGOS, named in every notice (the
    # reader verifies that kind): xxh3-128 by default, the cheapest in the engine's CPU
    # (sample_file.CONNECTOR_CHECKSUM_ALGO says why). blake3's threads per checksum (0: all
    # cores): each shortens a sample's checksum and adds CPU taken from the engine; xxh3 has one.
    checksum: str = CONNECTOR_CHECKSUM_ALGO
    checksum_threads: int = Field(default=1, ge=0, le=1024)
    # Connector, FP8 payload on CUDA: quantise on the GPU's side stream before the copy to the
    # host (half the bytes copied; on an H200 vLLM 0.971 of plain instead of 0.935, and the same
    # bytes as the host quantiser's, hard values included: docs/benchmarks.md). False: on the
    # writer thread, as on CPU (where there is no copy to shrink and the gather runs on the step).
    fp8_on_device: bool = True
    # How hidden states are stored (connector/contract/payload.py): "model" (the verifier's dtype) or
    # "fp8_e4m3" (hs-connectors' FP8 layout, per-token scales: ~0.5x the bytes). Read by the
    # connector (writes it) and the sidecar (prices samples by it before the first notice).
    payload_dtype: str = "model"

    @field_validator("switch_interval_ms")
    @classmethod
    def _switch_interval(cls, v: float) -> float:
        if v != 0 and not MIN_SWITCH_INTERVAL_MS <= v <= 1000:
            # Below ~50 µs threads hand the interpreter back and forth more than they run.
            raise ValueError(f"must be 0 (leave Python's) or between {MIN_SWITCH_INTERVAL_MS} and 1000 ms, got {v}")
        return v

    @model_validator(mode="after")
    def _no_plain_tcp(self) -> Settings:
        """The notice and delivery sockets have no CURVE: on a network address they are refused
        (``connector/contract/endpoints.py``) wherever the settings are read, so no role starts on them."""
        for name, ep, exposes in (("HSSTREAM_NOTICE_ENDPOINT", self.notice_endpoint, E.NOTICE_EXPOSES),
                                  ("HSSTREAM_DELIVERY_ENDPOINT", self.delivery_endpoint, E.DELIVERY_EXPOSES)):  # fmt: skip
            E.check_plain(name, ep, allow=self.allow_insecure_tcp, exposes=exposes, fix=E.SIDECAR_FIX)
        return self

    @field_validator("layer_ids", mode="before")
    @classmethod
    def _split_ids(cls, v: object) -> object:
        if isinstance(v, str):
            return [int(x) for x in v.replace(",", " ").split()] if v.strip() else []
        return v

    def notice_ep(self) -> str:
        return self.notice_endpoint or f"ipc://{self.run_dir}/notice.sock"

    def ledger_file(self) -> Path:
        """``ledger_path``; else ``ledger.sqlite`` in ``state_dir`` if that was given; else in a
        ``run_dir`` that was given (a stack of its own: a second stack, a test, keeps its own
        ledger beside its sockets); else in the default state dir, which survives a reboot."""
        if self.ledger_path:
            return self.ledger_path
        given = self.model_fields_set
        if "run_dir" in given and "state_dir" not in given:
            return self.run_dir / "ledger.sqlite"
        return self.state_dir / "ledger.sqlite"

    def delivery_ep(self) -> str:
        return self.delivery_endpoint or f"ipc://{self.run_dir}/delivery.sock"


#: The smallest switch interval accepted (``switch_interval_ms``), in milliseconds.
MIN_SWITCH_INTERVAL_MS = 0.05


def lower_switch_interval(ms: float) -> None:
    """Python's thread switch interval down to ``ms`` (``switch_interval_ms``); never raised, and
    0 leaves it. For processes whose latency-bound threads share the interpreter with busy ones."""
    if 0 < ms / 1000 < sys.getswitchinterval():
        sys.setswitchinterval(ms / 1000)
