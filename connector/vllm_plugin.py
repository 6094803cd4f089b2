"""The vLLM KV-connector class: the only module of ours that imports vLLM.

vLLM instantiates it twice: role SCHEDULER in the EngineCore process (``SchedulerSide``) and
role WORKER in every worker (``HiddenStateGatherer`` + ``SpoolWriter``); the two halves share
nothing but the pickled per-step metadata. Load it with::

    --kv-transfer-config '{"kv_connector": "HiddenStatesStreamConnector",
                           "kv_connector_module_path": "connector.vllm_plugin",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/hsstream",
                                                         "notice_endpoint": "ipc:///run/hsstream/notice.sock"}}'

``shared_storage_path``, ``num_writer_threads``, ``allow_custom_save_path`` and
``use_synchronization_lock`` mean what they mean for vLLM's ``ExampleHiddenStatesConnector``;
``include_output_tokens`` and ``hidden_states_path`` per request too. Ours: ``notice_endpoint``
(``"none"``: no sidecar), ``layer_ids`` (the order written), ``layer_order`` (``config``:
that order; ``sorted``: ascending, as the Example connector writes) and ``payload_dtype``
(``model`` or ``fp8_e4m3``, ``connector/contract/payload.py``). See docs/drop-in.md.

Which hooks vLLM calls when, runner by runner (V1; V2 as in 0.32; V2 with ``finalize_step`` as
in 0.33/0.34), is ``connector/contract/vllm_hooks.py``: the class takes a step's saves when the
metadata is bound and does the work in ``get_finished``, so it assumes nothing about where
``wait_for_save`` and the metadata's ``clear`` fall. What vLLM added since is handled where the
base class has it (sleep mode's ``unregister_kv_caches`` / ``restore_kv_caches``,
``kv_cache_access``); docs/vllm-versions.md lists each change and the module it touched.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from connector.contract import endpoints as E
from connector.contract import payload as PL
from connector.contract import sample_file as SF
from connector.contract.settings import Settings, lower_switch_interval
from connector.layers import storage_permutation, validate_layer_ids
from connector.scheduler_side import SchedulerSide
from connector.spool_writer import ShapeInfo, SpoolWriter
from connector.step_metadata import LockRequest, PendingSave
from connector.worker_side import HiddenStateGatherer, WorkerSide

try:  # vLLM 0.34+: how a connector reaches the device KV cache (a feature check, not a version's)
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:
    KVCacheAccess = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("hsstream.connector")


class ConnectorConfigError(ValueError):
    pass


@dataclass
class StreamConnectorMetadata(KVConnectorMetadata):
    pending: list[PendingSave] = field(default_factory=list)
    new_locks: dict[str, LockRequest] = field(default_factory=dict)


#: Every kv_connector_extra_config key we read; any other is named in a warning at start-up.
KNOWN_EXTRA_KEYS = frozenset({
    "shared_storage_path", "num_writer_threads", "allow_custom_save_path", "use_synchronization_lock",  # Example's
    "notice_endpoint", "layer_ids", "layer_order", "payload_dtype", "checksum", "checksum_threads", "fp8_on_device",  # ours
})  # fmt: skip
LAYER_ORDERS = ("config", "sorted")
NO_NOTICES = "none"


def _flag(extra: dict, key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be true or false, got {v!r}")


@dataclass(frozen=True)
class ConnectorOptions:
    spool_dir: str
    notice_endpoint: str
    num_writer_threads: int
    max_pending_write_bytes: int
    max_queued_notices: int
    checksum_algo: str
    user_layer_ids: list[int]
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    model: str
    layer_order: str = "config"
    payload_dtype: str = PL.MODEL
    allow_custom_save_path: bool = False
    use_lock: bool = True
    switch_interval_ms: float = 1.0
    checksum_threads: int = 1  # blake3's per sample (0: all cores); see sample_file.CONNECTOR_CHECKSUM_ALGO
    fp8_on_device: bool = True  # FP8 quantised on the GPU before the copy, on CUDA (HSSTREAM_FP8_ON_DEVICE)

    @property
    def file_layer_ids(self) -> list[int]:
        """The layer order written into files (and notices)."""
        return sorted(self.user_layer_ids) if self.layer_order == "sorted" else list(self.user_layer_ids)

    @property
    def stored_dtype(self) -> str:
        """The dtype files hold (notices name it): the model's, or the quantised payload's."""
        return PL.stored_dtype(self.payload_dtype, self.dtype)

    @property
    def notice_ep(self) -> str | None:
        return None if self.notice_endpoint == NO_NOTICES else self.notice_endpoint

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorOptions:
        """Read and check everything once, at start-up, with errors a user can act on."""
        kvt = vllm_config.kv_transfer_config
        extra = dict(getattr(kvt, "kv_connector_extra_config", None) or {})
        env = Settings()
        unknown = sorted(set(extra) - KNOWN_EXTRA_KEYS)
        if unknown:
            log.warning(
                "kv_connector_extra_config: ignoring unknown key(s) %s (known: %s)", unknown, sorted(KNOWN_EXTRA_KEYS)
            )
        order = str(extra.get("layer_order") or env.layer_order)
        if order not in LAYER_ORDERS:
            raise ConnectorConfigError(f"kv_connector_extra_config.layer_order {order!r}: use one of {LAYER_ORDERS}")
        spec = vllm_config.speculative_config
        if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
            raise ConnectorConfigError(
                "HiddenStatesStreamConnector needs vLLM's speculative method 'extract_hidden_states' "
                '(--speculative-config \'{"method": "extract_hidden_states", "num_speculative_tokens": 1, ...}\')'
            )
        hf = spec.draft_model_config.hf_config
        spec_ids = list(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or [])
        n_layers = vllm_config.model_config.get_total_num_hidden_layers()
        user_ids = validate_layer_ids(extra.get("layer_ids") or spec_ids, n_layers)
        if sorted(user_ids) != sorted(validate_layer_ids(spec_ids, n_layers)):
            raise ConnectorConfigError(
                f"kv_connector_extra_config.layer_ids {user_ids} and the speculative config's "
                f"eagle_aux_hidden_state_layer_ids {spec_ids} name different layers"
            )
        spool = str(extra.get("shared_storage_path") or env.spool_dir)
        endpoint = str(extra.get("notice_endpoint") or env.notice_ep())
        if not endpoint:
            raise ConnectorConfigError("no notice endpoint: set kv_connector_extra_config.notice_endpoint")
        if "notice_endpoint" in extra:  # HSSTREAM_NOTICE_ENDPOINT was checked with the settings
            try:
                E.check_plain("kv_connector_extra_config.notice_endpoint", endpoint, allow=env.allow_insecure_tcp,
                              exposes=E.NOTICE_EXPOSES, fix=E.SIDECAR_FIX)  # fmt: skip
            except E.InsecureEndpoint as e:
                raise ConnectorConfigError(str(e)) from None
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        algo = str(extra.get("checksum") or env.checksum)
        if algo not in SF.CHECKSUM_ALGOS:
            raise ConnectorConfigError(f"checksum {algo!r} is not one of {list(SF.CHECKSUM_ALGOS)} (HSSTREAM_CHECKSUM)")
        threads = extra.get("checksum_threads", env.checksum_threads)
        if type(threads) is not int or threads < 0:  # the setting's own bound is checked by Settings
            raise ConnectorConfigError(f"kv_connector_extra_config.checksum_threads must be an integer >= 0 "
                                       f"(0: all cores), got {threads!r}")  # fmt: skip
        model = str(getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model)
        payload_dtype = str(extra.get("payload_dtype") or env.payload_dtype)
        try:
            PL.check_payload_dtype(payload_dtype)
        except PL.PayloadError as e:
            raise ConnectorConfigError(f"kv_connector_extra_config.payload_dtype: {e}") from e
        return cls(
            spool_dir=spool,
            notice_endpoint=endpoint,
            num_writer_threads=int(extra.get("num_writer_threads", env.num_writer_threads)),
            max_pending_write_bytes=int(extra.get("max_pending_write_bytes", env.max_pending_write_bytes)),
            max_queued_notices=int(extra.get("max_queued_notices", env.max_queued_notices)),
            checksum_algo=algo,
            user_layer_ids=user_ids,
            num_hidden_layers=n_layers,
            hidden_size=vllm_config.model_config.get_hidden_size(),
            dtype=dtype,
            model=model,
            layer_order=order,
            payload_dtype=payload_dtype,
            allow_custom_save_path=_flag(extra, "allow_custom_save_path", False),
            use_lock=_flag(extra, "use_synchronization_lock", True),
            switch_interval_ms=env.switch_interval_ms,
            checksum_threads=threads,
            fp8_on_device=_flag(extra, "fp8_on_device", env.fp8_on_device),
        )


def check_spool(spool: str) -> None:
    """Refuse a spool we cannot trust with the hidden states (token ids are users' prompts): a
    symlink (one planted in the world-writable /dev/shm would send them elsewhere), a directory
    of another user, or one that others can write (they could swap a file between its rename
    and its notice). The same rules as ``protocol.claim_spool``, which the sidecar and
    ``hsstream up`` apply; the connector also runs alone (drop-in), with no sidecar to check."""
    path = spool.rstrip("/") or "/"  # "link/" would resolve the link
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConnectorConfigError(f"spool directory {spool!r} does not exist (create it, e.g. on /dev/shm)") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConnectorConfigError(
            f"spool directory {spool!r} is a symlink (to {os.readlink(path)!r}): refusing it, since a link in a "
            "shared directory may have been planted by another user; point the spool at the directory itself"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectorConfigError(f"spool directory {spool!r} does not exist (it is not a directory)")
    if st.st_uid != os.geteuid():
        raise ConnectorConfigError(
            f"spool directory {spool!r} belongs to uid {st.st_uid}, not to this process's user (uid "
            f"{os.geteuid()}): refusing it; use a directory this user created (mode 0700)"
        )
    if st.st_mode & 0o022:
        raise ConnectorConfigError(
            f"spool directory {spool!r} is writable by other users (mode {oct(stat.S_IMODE(st.st_mode))}): "
            f"refusing it; run `chmod 700 {spool}`"
        )
    if not os.access(spool, os.W_OK | os.X_OK):
        raise ConnectorConfigError(f"spool directory {spool!r} is not writable by this process")


class HiddenStatesStreamConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.opts = ConnectorOptions.from_vllm(vllm_config)
        check_spool(self.opts.spool_dir)
        self._group_id = _hidden_state_group(kv_cache_config)
        self._block_size = _group_block_size(vllm_config, kv_cache_config, self._group_id)
        o = self.opts
        self._scheduler = (
            SchedulerSide(o.spool_dir, allow_custom_save_path=o.allow_custom_save_path, use_lock=o.use_lock)
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        if o.allow_custom_save_path and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "allow_custom_save_path is on: API clients can have hidden states written to any path this "
                "server can write. Only enable it with trusted clients."
            )
        self._writer: SpoolWriter | None = None
        self._worker = WorkerSide(None, None)  # until register_kv_caches; stays inert off rank 0
        self._kv_caches: dict[str, torch.Tensor] | None = None  # vLLM's own dict (sleep mode re-reads it)
        self._cache_layer: str | None = None
        self._bound: list[StreamConnectorMetadata] = []  # the steps' metadata bound since get_finished
        log.info(
            "hsstream connector (%s): spool %s, notices -> %s, layers %s (file order: %s), payload %s",
            role.name, o.spool_dir, o.notice_endpoint, o.user_layer_ids, o.file_layer_ids, o.stored_dtype,
        )

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False  # the draft's cache must stay apart from the verifier's

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 writes; the others never report

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ asks before it enables sleep mode: we follow its cache remap
        (``unregister_kv_caches`` drains our copies, ``restore_kv_caches`` takes the cache again)."""
        return True

    if KVCacheAccess is not None:

        @classmethod
        def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
            """Only this worker process reads the cache, with torch ops: any allocation works."""
            return KVCacheAccess.IN_PROCESS

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ConnectorConfigError(f"expected one hidden-state cache layer, found {len(names)}: {names}")
        if get_tensor_model_parallel_rank() != 0:
            return
        self._kv_caches, self._cache_layer = kv_caches, names[0]
        o = self.opts
        self._writer = SpoolWriter(
            o.spool_dir,
            o.notice_ep,
            ShapeInfo(o.file_layer_ids, o.num_hidden_layers, o.hidden_size, o.stored_dtype, o.model),
            num_threads=o.num_writer_threads,
            max_pending_bytes=o.max_pending_write_bytes,
            max_queued_notices=o.max_queued_notices,
            checksum_algo=o.checksum_algo,
            checksum_threads=o.checksum_threads,
        )
        gatherer = HiddenStateGatherer(
            kv_caches[names[0]],
            self._block_size,
            len(o.file_layer_ids),
            storage_permutation(o.file_layer_ids),
            self._writer,
            encode_at_gather=None if o.fp8_on_device else False,  # None: on CUDA only (worker_side)
        )
        self._worker = WorkerSide(gatherer, self._writer)
        # The writer and notice threads share this process's interpreter with vLLM's worker loop,
        # which holds it for most of a step: each hand-off (a copy landed, a notice to send) waited
        # up to Python's 5 ms for a switch.
        lower_switch_interval(o.switch_interval_ms)

    def unregister_kv_caches(self) -> None:
        """Sleep mode (vLLM 0.33+): the cache's memory is about to be released. Every copy from it
        finishes now; a save that arrives before ``restore_kv_caches`` gets an error notice."""
        self._worker.release_cache()

    def restore_kv_caches(self) -> None:
        """Sleep mode's wake-up: the cache is readable again, through the tensor vLLM now holds
        for its layer (a view taken before the sleep may point at the released memory)."""
        if self._kv_caches is not None and self._cache_layer is not None:
            self._worker.retake_cache(self._kv_caches[self._cache_layer])

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The step's saves are taken here, the one hook every runner calls first
        # (connector/contract/vllm_hooks.py): get_finished does the work, and whether the metadata
        # is still bound by then (or wait_for_save has run) differs between vLLM's runners.
        if isinstance(connector_metadata, StreamConnectorMetadata) and not any(
            m is connector_metadata for m in self._bound
        ):
            self._bound.append(connector_metadata)
        # Before this step's forward is launched: the copies this step queues (for requests the
        # previous step finished) wait for what is on the GPU now, not for this forward too.
        self._worker.step_starts()

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        pass  # the dummy draft already wrote the states into its cache during the forward

    def wait_for_save(self) -> None:
        pass  # nothing to wait for: copies finish asynchronously, reported by get_finished

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        pending: list[PendingSave] = []
        new_locks: dict[str, LockRequest] = {}
        bound, self._bound = self._bound, []
        for meta in bound:
            pending += meta.pending
            new_locks.update(meta.new_locks)
        return self._worker.step(pending, finished_req_ids, new_locks), None

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._worker.close()

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.request_scheduled(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return StreamConnectorMetadata(pending=self._scheduler.take_pending(), new_locks=self._scheduler.take_new_locks())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        ids = block_ids[self._group_id] if 0 <= self._group_id < len(block_ids) else []
        return self.request_finished(request, ids)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # A token's layers stored together (one contiguous row per token). "NHD" is the name
        # every supported version knows; 0.30+ treats it as an alias of "LBNHC".
        return "NHD"


def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """The KV-cache group of the dummy draft, found by its spec type (same on both sides)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ConnectorConfigError(
        f"cannot find the hidden-state cache among {len(groups)} KV-cache groups (MLA verifiers are unsupported)"
    )


def _group_block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, gid: int) -> int:
    # cache_config.block_size is bumped for hybrid models; the group's own spec is right.
    if kv_cache_config is None:
        return vllm_config.cache_config.block_size
    return kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
