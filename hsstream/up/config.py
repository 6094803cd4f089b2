"""What ``hsstream up`` starts, resolved before anything starts: :class:`UpConfig`.

One module for everything that is decided from flags, the environment and compose's ``.env``
(``build_config``), and the vLLM command line and engine names that follow from it, so the
supervisor acts on a finished configuration and a mistake found here is an :class:`UpError`
raised before any process exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hsstream import launch


class UpError(RuntimeError):
    """A problem a user can fix before anything starts (port taken, bad layer ids, ...)."""


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
    #: The environment the children start from instead of this process's (read at each spawn): for a
    #: caller that starts a stack from a thread while the rest of its process changes its environment.
    base_env: dict[str, str] | None = None
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

    from hsstream import assets

    mdl = model or s.model or get("MODEL_DIR")
    if mdl and (mdl == get("MODEL_DIR") or os.path.isabs(mdl) or mdl.startswith(".")) and not os.path.isdir(mdl):
        # a path, not a hub name: say so now rather than after vLLM has started and failed
        raise UpError(f"model folder {mdl} does not exist (--model, HSSTREAM_MODEL or MODEL_DIR)")
    try:  # a short name (smollm2) is its cached checkpoint; none at all: the default real model, if fetched
        mdl = assets.resolve_model(mdl) if mdl else assets.default_model()
    except assets.NotFetched as e:
        raise UpError(str(e)) from None
    if not model and not s.model and not get("MODEL_DIR"):
        say(f"no model configured (--model, HSSTREAM_MODEL or MODEL_DIR): using {assets.DEFAULT_MODEL} ({mdl})")
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
