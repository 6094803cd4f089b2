"""In-place draft updates for a serving vLLM: a weight-transfer backend that reads a checkpoint
from the local file system, and the client side that drives it (``push_draft``).

vLLM 0.32 and 0.34 take new weights into a serving engine through its weight-transfer API
(``POST /start_draft_weight_update``, ``/update_weights``, ``/finish_weight_update``; mounted
with ``VLLM_SERVER_DEV_MODE=1``), but every built-in backend (``nccl``, ``ipc``,
``sparse_nccl``, ``sharded_rdt``, ``nccl_m2n``, ``modelexpress``) moves CUDA tensors: on the
CPU build none can work (``ipc`` rebuilds CUDA IPC handles, the others need NCCL). The API
itself is device-neutral (``WeightTransferEngine`` in ``vllm/distributed/weight_transfer/base.py``),
and its factory takes registered backends. This one, ``hsstream_file``, is registered by our
vLLM general plug-in in every vLLM process: an update names a speculators-format draft
directory on the engine's host, and the worker loads its safetensors into the live draft with
the draft model's own ``load_weights`` (the same call vLLM's loader made at start-up). Requests
keep running: the update runs between two engine steps (vLLM's collective RPC), and speculative
decoding stays lossless whatever the draft, so the new weights only change how many tokens are
accepted from the next step on.

It loads weights into the draft that was started; a draft of another shape (another
vocabulary size, another number of layers, another method) needs a blue/green swap.

The engine must run with ``--weight-transfer-config '{"backend": "hsstream_file"}'`` and
``VLLM_SERVER_DEV_MODE=1`` (it then binds loopback: the serving proxy forwards none of the
development routes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BACKEND = "hsstream_file"
WEIGHT_TRANSFER_CONFIG = {"backend": BACKEND}


class DraftFilesError(ValueError):
    pass


def draft_files(path: str | Path) -> list[Path]:
    """The safetensors files of a speculators-format draft directory, checked."""
    d = Path(path)
    if not d.is_dir() or not (d / "config.json").is_file():
        raise DraftFilesError(f"{path}: not a draft directory (no config.json)")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise DraftFilesError(f"{path}: no *.safetensors")
    return files


def draft_shapes(path: str | Path) -> tuple[str | None, dict[str, tuple[int, ...]]]:
    """A draft directory's method and the name and shape of each tensor in its safetensors (the
    files' headers only: no tensor is read)."""
    from safetensors import safe_open

    c = json.loads((Path(path) / "config.json").read_text())
    out: dict[str, tuple[int, ...]] = {}
    for f in draft_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118
                out[k] = tuple(fh.get_slice(k).get_shape())
    return c.get("speculators_model_type"), out


def same_shape(a: str | Path, b: str | Path) -> bool:
    """Whether draft ``b``'s weights load in place into an engine started with draft ``a``: the same
    method and the same tensor names and shapes."""
    try:
        return draft_shapes(a) == draft_shapes(b)
    except (DraftFilesError, OSError, ValueError):
        return False


def iter_weights(path: str | Path):  # noqa: ANN201
    from safetensors import safe_open

    for f in draft_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                yield name, fh.get_tensor(name)


def _engine_class() -> type:
    """Built when vLLM asks for it (``WeightTransferEngineFactory``): the base class is vLLM's."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        path: str
        version: str | None = None
        #: log a digest of the live draft's parameters before and after the load (evidence that
        #: the module proposing tokens changed; a pass over the draft's bytes)
        digest: bool = False

    class FileWeightTransferEngine(WeightTransferEngine):
        """Loads a draft directory's weights into the live draft (``update_weights {"path"}``)."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = True

        def init_transfer_engine(self, init_info: Any) -> None:  # noqa: ANN401
            pass  # nothing to meet: the files are on this host

        def start_weight_update(self) -> None:
            pass

        def finish_weight_update(self) -> None:
            pass

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), for asynchronous GPU
            # transfers; this load is synchronous, and the CPU build has no accelerator.
            self.receive_weights(self.parse_update_info(update_info))

        def _digest(self) -> str:
            import hashlib

            h = hashlib.sha256()
            for name, p in sorted(self.model.named_parameters()):
                h.update(name.encode())
                h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
            return h.hexdigest()[:16]

        def receive_weights(self, update_info: Any) -> None:  # noqa: ANN401
            import logging

            import torch
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            started = getattr(self.model_config, "model", None)  # the draft dir the engine started with
            if started and Path(started).is_dir() and not same_shape(started, update_info.path):
                raise RuntimeError(f"{update_info.path}: not of the serving draft's shape ({started}): its weights "
                                   "cannot load in place (a blue/green swap can serve it)")  # fmt: skip
            before = self._digest() if update_info.digest else None
            names = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
            # vLLM's layer-wise reload (what its own backends use): each layer's parameters back
            # at their checkpoint shapes, the new weights loaded, and each layer processed again as
            # at start-up. Loading straight into the parameters fails on the CPU build: its
            # linear layers pack their weights for oneDNN at start-up and keep an empty parameter.
            initialize_layerwise_reload(self.model)
            try:
                with torch.no_grad():
                    loaded = self.model.load_weights(iter_weights(update_info.path))
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
            if loaded is not None and names and not set(loaded) & names:
                raise RuntimeError(f"{update_info.path}: no weight of it matched the serving draft")
            if before is not None:
                logging.getLogger("vllm").warning("hsstream_file: draft parameters %s -> %s (version %s, %s)", before,
                                                  self._digest(), update_info.version, update_info.path)  # fmt: skip

        def shutdown(self) -> None:
            pass

    return FileWeightTransferEngine


def register() -> None:
    """vLLM general plug-in: make ``hsstream_file`` a weight-transfer backend in this process."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API
        return
    if BACKEND in WeightTransferEngineFactory._registry:  # noqa: SLF001 - registered once per process
        return
    WeightTransferEngineFactory.register_engine(BACKEND, "hsstream.weight_swap", "FileWeightTransferEngine")


def __getattr__(name: str) -> Any:  # noqa: ANN401
    if name == "FileWeightTransferEngine":  # the factory's lazy lookup: vLLM is imported only then
        cls = _engine_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# ----------------------------------------------------------------------------- the client side
async def push_draft(session: Any, url: str, draft: str, version: str, timeout_s: float = 600.0,  # noqa: ANN401
                     digest: bool = False) -> None:  # fmt: skip
    """Load ``draft`` into the live draft of the engine at ``url`` (an aiohttp session);
    ``digest``: the engine logs its draft's parameter digest before and after."""
    import aiohttp

    draft_files(draft)
    t = aiohttp.ClientTimeout(total=timeout_s)

    async def post(path: str, body: dict) -> None:
        async with session.post(url + path, json=body, timeout=t) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}{path}: {r.status} {(await r.text())[:500]}")

    await post("/start_draft_weight_update", {})
    try:
        await post("/update_weights", {"update_info": {"path": str(Path(draft).resolve()), "version": version,
                                                       "digest": digest}})  # fmt: skip
    except BaseException:
        try:  # leave the update session if the worker did not already (it does when a load fails)
            await post("/finish_weight_update", {"weight_version": None})
        except RuntimeError:
            pass
        raise
    await post("/finish_weight_update", {"weight_version": version})


def describe() -> str:
    return json.dumps(WEIGHT_TRANSFER_CONFIG)
