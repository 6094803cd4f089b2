"""When vLLM's model runners call a KV connector's worker hooks in one engine step, as read in
vLLM's source, runner by runner: the contract our connector is written against.

The connector reads a step's saves from the metadata it is given at ``bind_connector_metadata``
and does its work in ``get_finished``; what it may assume about the rest (is ``wait_for_save``
before or after ``get_finished``? is the metadata still bound? has the extraction model written
this step's hidden states yet?) changed between runners:

* V1 runner (vLLM ≤ 0.33, ``gpu_model_runner.py`` and the CPU build's): with a speculative config
  (extraction always has one) ``get_finished`` runs before the draft model, ``wait_for_save`` and
  the metadata's ``clear`` after it (``finalize_kv_connector``);
* V2 runner of 0.32 (``vllm/v1/worker/gpu/``): the whole ``post_forward`` (``wait_for_save``,
  ``get_finished``, ``clear``) after the draft model;
* V2 runner of 0.33 and 0.34 (the only runner of 0.34): ``post_forward(defer_finalize=True)``
  before the draft model, then ``finalize_step()``: ``wait_for_save`` and ``clear``;
* a step with nothing to run (``no_forward`` / ``kv_connector_no_forward``): bind, ``wait_for_save``,
  ``get_finished``, ``clear``.

Each runner below is the calls its functions make, in source order, with the ``if`` conditions
around each (:class:`Fn`), exactly as ``bench/long_checks/vllm_conformance.py`` (``make vllm-conformance``)
reads them in each vLLM wheel it checks: a vLLM that changes one fails that target. :func:`step`
expands them, for one path through the runner (its conditions' truth values), into the hooks the
connector sees; ``tests/unit/connector/test_hook_order.py`` drives the real connector through
exactly those, so the test cannot drift from vLLM's source. The extraction model's write of a
step's hidden states into its cache happens in the draft model's ``propose`` (:data:`PROPOSE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: The draft model runs: vLLM's extraction model writes this step's hidden states into its cache.
PROPOSE = "<propose>"
#: The body of a context manager runs here (the mixin's ``yield``: the forward, or nothing).
BODY = "<yield>"


@dataclass(frozen=True)
class Call:
    """One call (or an assignment ``=NAME``) as read in a function, in source order."""

    name: str  # dotted, as written: "self.kv_connector.wait_for_save", "propose_draft_token_ids", "=defer"
    conditions: tuple[str, ...] = ()  # the enclosing ifs' tests, as ast.unparse writes them; else: "not (X)"
    keywords: tuple[str, ...] = ()  # "defer_finalize=defer_kv_finalize" (calls); the value (assignments)
    exits: bool = False  # it is in an ``if`` branch that ends in ``return`` (the function stops there)


@dataclass(frozen=True)
class Fn:
    """A function of vLLM's runner: which calls of it are read, and those calls."""

    file: str  # relative to site-packages: "vllm/v1/worker/gpu/kv_connector.py"
    qualname: str  # "ActiveKVConnector.post_forward"
    #: dotted names (or prefixes ending in ".") of the calls read; assignments to names listed as "=NAME"
    reads: tuple[str, ...]
    calls: tuple[Call, ...]
    #: a prefix whose calls are the connector's hooks (the rest of the name is the hook)
    hook_prefix: str | None = None
    #: parameter defaults the conditions use (``post_forward``'s ``defer_finalize=False``)
    defaults: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class Runner:
    """A model runner of some vLLM versions: its functions, the links between them, and its paths."""

    name: str
    versions: tuple[str, ...]  # the vLLM releases whose source has exactly these calls (checked)
    fns: tuple[Fn, ...]
    #: a call's dotted name → the function of ``fns`` it runs (qualname)
    links: Mapping[str, str]
    #: calls that run the draft model (where the extraction model writes the cache)
    propose: tuple[str, ...]
    #: path name → (entry functions run in turn, the truth of each condition on that path)
    paths: Mapping[str, tuple[tuple[str, ...], Mapping[str, bool]]]

    def fn(self, qualname: str) -> Fn:
        return next(f for f in self.fns if f.qualname == qualname)


class HookOrderError(ValueError):
    """The data cannot be expanded (an unknown condition, a missing link): fix this module."""


def _truth(cond: str, env: Mapping[str, bool]) -> bool:
    if cond in env:
        return bool(env[cond])
    if cond.startswith("not (") and cond.endswith(")"):
        return not _truth(cond[5:-1], env)
    if cond.startswith("not "):
        return not _truth(cond[4:], env)
    raise HookOrderError(f"no truth value for the condition {cond!r}")


def step(runner: Runner, path: str) -> list[str]:
    """The connector hooks (and :data:`PROPOSE`, :data:`BODY`) one step of ``path`` calls, in order."""
    entries, env = runner.paths[path]
    out: list[str] = []

    def run(qualname: str, scope: dict[str, bool], depth: int = 0) -> None:
        if depth > 8:
            raise HookOrderError(f"{runner.name}: calls nest too deep at {qualname}")
        fn = runner.fn(qualname)
        local = {**env, **fn.defaults, **scope}
        for c in fn.calls:
            if c.name.startswith("="):  # an assignment the conditions read
                local[c.name[1:]] = _truth(c.keywords[0], local)
                continue
            if not all(_truth(x, local) for x in c.conditions):
                continue
            if c.name == BODY:
                out.append(BODY)
            elif c.name in runner.propose:
                out.append(PROPOSE)
            elif fn.hook_prefix and c.name.startswith(fn.hook_prefix):
                out.append(c.name[len(fn.hook_prefix):])
            elif c.name in runner.links:
                bound = {}
                for kw in c.keywords:
                    k, _, v = kw.partition("=")
                    bound[k] = _truth(v, local)
                run(runner.links[c.name], bound, depth + 1)
            else:
                raise HookOrderError(f"{runner.name}: {qualname} calls {c.name}, which is neither a hook nor linked")
            if c.exits:
                return

    for e in entries:
        run(e, {})
    return out


# ------------------------------------------------------------------------------------------------
# The runners, as read (bench/long_checks/vllm_conformance.py checks each against the wheels of its versions)
# ------------------------------------------------------------------------------------------------

_MIXIN = "vllm/v1/worker/kv_connector_model_runner_mixin.py"
_V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_V2_CONNECTOR = "vllm/v1/worker/gpu/kv_connector.py"
_V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"

_GET_OUTPUT_TAIL = (
    Call("kv_connector.get_transfer_results"),
    Call("kv_connector.get_block_ids_with_load_errors"),
    Call("kv_connector.get_kv_connector_stats"),
    Call("kv_connector.get_kv_connector_kv_cache_events"),
    Call("kv_connector.build_connector_worker_meta"),
)

V1 = Runner(
    name="v1",
    versions=("0.32.0", "0.33.0"),
    fns=(
        Fn(_MIXIN, "KVConnectorModelRunnerMixin._get_kv_connector_output", ("kv_connector.", BODY, "=start_after_forward"), (
            Call("kv_connector.bind_connector_metadata"),
            Call("=start_after_forward", (), ("not scheduler_output.has_sync_kv_loads",)),
            Call("kv_connector.start_load_kv", ("not start_after_forward",)),
            Call(BODY),
            Call("kv_connector.start_load_kv", ("start_after_forward",)),
            Call("kv_connector.wait_for_save", ("not defer_finalize",)),
            *_GET_OUTPUT_TAIL,
            Call("kv_connector.clear_connector_metadata", ("not defer_finalize",)),
        ), hook_prefix="kv_connector.", defaults={"defer_finalize": False}),
        Fn(_MIXIN, "KVConnectorModelRunnerMixin.finalize_kv_connector", ("kv_connector.",), (
            Call("kv_connector.wait_for_save", ("has_kv_transfer_group()",)),
            Call("kv_connector.clear_connector_metadata", ("has_kv_transfer_group()",)),
        ), hook_prefix="kv_connector."),
        Fn(_MIXIN, "KVConnectorModelRunnerMixin.maybe_get_kv_connector_output", ("KVConnectorModelRunnerMixin.",), (
            Call("KVConnectorModelRunnerMixin._get_kv_connector_output", (), ("defer_finalize=defer_finalize",), exits=True),
        ), defaults={"defer_finalize": False}),
        Fn(_MIXIN, "KVConnectorModelRunnerMixin.kv_connector_no_forward", ("KVConnectorModelRunnerMixin.",), (
            Call("KVConnectorModelRunnerMixin._get_kv_connector_output"),
        )),
        Fn(_V1_RUNNER, "GPUModelRunner.execute_model",
           ("self.maybe_get_kv_connector_output", "self.kv_connector_no_forward", "=defer_kv_connector_finalize"), (
            Call("self.kv_connector_no_forward", ("not num_scheduled_tokens",), exits=True),
            Call("=defer_kv_connector_finalize", (), ("self.speculative_config is not None",)),
            Call("self.maybe_get_kv_connector_output", (), ("defer_finalize=defer_kv_connector_finalize",)),
        )),
        Fn(_V1_RUNNER, "GPUModelRunner.sample_tokens", ("propose_draft_token_ids", "self.finalize_kv_connector"), (
            Call("propose_draft_token_ids", ("spec_config is not None", "use_gpu_toks", "input_fits_in_drafter")),
            Call("propose_draft_token_ids", ("spec_config is not None", "not (use_gpu_toks)",
                                             "spec_config.use_ngram_gpu() and (not spec_config.disable_padded_drafter_batch)",
                                             "input_fits_in_drafter")),  # fmt: skip
            Call("propose_draft_token_ids", ("draft_after_bookkeeping", "input_fits_in_drafter")),
            Call("self.finalize_kv_connector", ("spec_config is not None",)),
        )),
    ),
    links={
        "self.maybe_get_kv_connector_output": "KVConnectorModelRunnerMixin.maybe_get_kv_connector_output",
        "self.kv_connector_no_forward": "KVConnectorModelRunnerMixin.kv_connector_no_forward",
        "KVConnectorModelRunnerMixin._get_kv_connector_output": "KVConnectorModelRunnerMixin._get_kv_connector_output",
        "self.finalize_kv_connector": "KVConnectorModelRunnerMixin.finalize_kv_connector",
    },
    propose=("propose_draft_token_ids",),
    paths={
        # A step that runs the model, with extraction's speculative config, no sync KV loads,
        # the drafter fed from GPU tokens (the default, padded drafter batch).
        "forward": (("GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens"), {
            "not num_scheduled_tokens": False, "scheduler_output.has_sync_kv_loads": False,
            "self.speculative_config is not None": True, "spec_config is not None": True, "use_gpu_toks": True,
            "input_fits_in_drafter": True, "draft_after_bookkeeping": False, "has_kv_transfer_group()": True,
        }),
        # A step with nothing scheduled (only finished requests to report).
        "no_forward": (("GPUModelRunner.execute_model",), {
            "not num_scheduled_tokens": True, "scheduler_output.has_sync_kv_loads": False,
            "self.speculative_config is not None": True,
        }),
    },
)


def _v2_connector_fns(deferred: bool) -> tuple[Fn, ...]:
    tail = (
        Call("self.kv_connector.get_transfer_results"),
        Call("self.kv_connector.get_block_ids_with_load_errors"),
        Call("self.kv_connector.get_kv_connector_stats"),
        Call("self.kv_connector.get_kv_connector_kv_cache_events"),
        Call("self.kv_connector.build_connector_worker_meta"),
    )
    when = ("not defer_finalize",) if deferred else ()
    fns = [
        Fn(_V2_CONNECTOR, "ActiveKVConnector.pre_forward", ("self.kv_connector.", "self._start_load_kv"), (
            Call("self.kv_connector.handle_preemptions"),
            Call("self.kv_connector.bind_connector_metadata"),
            Call("self._start_load_kv", ("scheduler_output.has_sync_kv_loads",)),
        ), hook_prefix="self.kv_connector."),
        Fn(_V2_CONNECTOR, "ActiveKVConnector._start_load_kv", ("self.kv_connector.",), (
            Call("self.kv_connector.start_load_kv", ("is_forward_context_available()",)),
            Call("self.kv_connector.start_load_kv", ("not (is_forward_context_available())",)),
        ), hook_prefix="self.kv_connector."),
        Fn(_V2_CONNECTOR, "ActiveKVConnector.finish_forward", ("self.kv_connector.",), (
            Call("self.kv_connector.finish_forward", ("not self._disabled",)),
        ), hook_prefix="self.kv_connector."),
        Fn(_V2_CONNECTOR, "ActiveKVConnector.post_forward", ("self.kv_connector.", "self._start_load_kv"), (
            Call("self._start_load_kv", ("self._pending_load_kwargs is not None",)),
            Call("self.kv_connector.wait_for_save", when),
            *tail,
            Call("self.kv_connector.clear_connector_metadata", when),
        ), hook_prefix="self.kv_connector.", defaults={"defer_finalize": False}),
        Fn(_V2_CONNECTOR, "ActiveKVConnector.no_forward", ("self.pre_forward", "self.finish_forward", "self.post_forward"), (
            Call("self.pre_forward"),
            Call("self.finish_forward"),
            Call("self.post_forward"),
        )),
    ]
    if deferred:
        fns.append(Fn(_V2_CONNECTOR, "ActiveKVConnector.finalize_step", ("self.kv_connector.",), (
            Call("self.kv_connector.wait_for_save"),
            Call("self.kv_connector.clear_connector_metadata"),
        ), hook_prefix="self.kv_connector."))
    return tuple(fns)


_V2_EXECUTE = Fn(_V2_RUNNER, "GPUModelRunner.execute_model", ("self.kv_connector.",), (
    Call("self.kv_connector.no_forward", ("not dummy_run", "scheduler_output.total_num_scheduled_tokens == 0"), exits=True),
    Call("self.kv_connector.no_forward", ("batch_desc.num_tokens == 0",), exits=True),
    Call("self.kv_connector.pre_forward", ("batch_desc.cg_mode == CUDAGraphMode.FULL",), ("attn_metadata=attn_metadata",)),
    Call("self.kv_connector.pre_forward", ("not (batch_desc.cg_mode == CUDAGraphMode.FULL)",)),
    Call("self.kv_connector.finish_forward"),
))
_V2_LINKS = {
    "self.kv_connector.no_forward": "ActiveKVConnector.no_forward",
    "self.kv_connector.pre_forward": "ActiveKVConnector.pre_forward",
    "self.kv_connector.finish_forward": "ActiveKVConnector.finish_forward",
    "self.kv_connector.post_forward": "ActiveKVConnector.post_forward",
    "self.kv_connector.finalize_step": "ActiveKVConnector.finalize_step",
    "self.pre_forward": "ActiveKVConnector.pre_forward",
    "self.finish_forward": "ActiveKVConnector.finish_forward",
    "self.post_forward": "ActiveKVConnector.post_forward",
    "self._start_load_kv": "ActiveKVConnector._start_load_kv",
}
_V2_FORWARD_TRUTH = {
    "not dummy_run": True, "scheduler_output.total_num_scheduled_tokens == 0": False, "batch_desc.num_tokens == 0": False,
    "batch_desc.cg_mode == CUDAGraphMode.FULL": False, "scheduler_output.has_sync_kv_loads": False,
    "is_forward_context_available()": True, "self._disabled": False, "self._pending_load_kwargs is not None": True,
    "self.is_last_pp_rank": True, "self.speculator is not None": True,
}  # fmt: skip
_V2_NO_FORWARD_TRUTH = {
    "not dummy_run": True, "scheduler_output.total_num_scheduled_tokens == 0": True,
    "scheduler_output.has_sync_kv_loads": False, "is_forward_context_available()": True, "self._disabled": False,
    "self._pending_load_kwargs is not None": True,
}

#: V2 as in 0.32: ``post_forward`` (wait_for_save, get_finished, clear) after the draft model.
V2_UNDEFERRED = Runner(
    name="v2-undeferred",
    versions=("0.32.0",),
    fns=(*_v2_connector_fns(deferred=False), _V2_EXECUTE,
         Fn(_V2_RUNNER, "GPUModelRunner.sample_tokens", ("self.kv_connector.", "self.speculator.propose"), (
             Call("self.kv_connector.post_forward", ("not self.is_last_pp_rank",), exits=True),
             Call("self.speculator.propose", ("self.speculator is not None",),
                  ("num_speculative_tokens=num_spec_tokens", "dp_sync_state=dp_sync_state", "mm_inputs=mm_inputs")),
             Call("self.kv_connector.post_forward"),
         ))),  # fmt: skip
    links=_V2_LINKS,
    propose=("self.speculator.propose",),
    paths={
        "forward": (("GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens"), _V2_FORWARD_TRUTH),
        "no_forward": (("GPUModelRunner.execute_model",), _V2_NO_FORWARD_TRUTH),
    },
)

#: V2 as in 0.33 and 0.34 (0.34's only runner): ``post_forward(defer_finalize=True)`` before the
#: draft model, ``finalize_step()`` (wait_for_save, clear) after it.
V2 = Runner(
    name="v2",
    versions=("0.33.0", "0.34.0"),
    fns=(*_v2_connector_fns(deferred=True), _V2_EXECUTE,
         Fn(_V2_RUNNER, "GPUModelRunner.sample_tokens",
            ("self.kv_connector.", "self.speculator.propose", "=defer_kv_finalize"), (
             Call("self.kv_connector.post_forward", ("not self.is_last_pp_rank",), exits=True),
             Call("=defer_kv_finalize", (), ("self.speculator is not None",)),
             Call("self.kv_connector.post_forward", (), ("defer_finalize=defer_kv_finalize",)),
             Call("self.speculator.propose", ("self.speculator is not None",),
                  ("num_speculative_tokens=num_spec_tokens", "dp_sync_state=dp_sync_state", "mm_inputs=mm_inputs")),
             Call("self.kv_connector.finalize_step", ("defer_kv_finalize",)),
         ))),  # fmt: skip
    links=_V2_LINKS,
    propose=("self.speculator.propose",),
    paths={
        "forward": (("GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens"), _V2_FORWARD_TRUTH),
        "no_forward": (("GPUModelRunner.execute_model",), _V2_NO_FORWARD_TRUTH),
    },
)

RUNNERS: tuple[Runner, ...] = (V1, V2_UNDEFERRED, V2)

#: The base class's implementations of the hooks above that our connector leaves to it: they
#: must do nothing but call ``get_finished`` (checked in each wheel by bench/long_checks/vllm_conformance.py).
INHERITED_HOOKS = {
    "get_transfer_results": "calls get_finished",
    "handle_preemptions": "no-op",
    "finish_forward": "no-op",
    "get_block_ids_with_load_errors": "no-op",
    "get_kv_connector_stats": "no-op",
    "get_kv_connector_kv_cache_events": "no-op",
    "build_connector_worker_meta": "no-op",
    "clear_connector_metadata": "clears the metadata",
}
