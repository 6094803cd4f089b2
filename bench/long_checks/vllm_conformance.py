"""``make vllm-conformance``: does our connector (and the serving of our drafts) still fit each vLLM
release? Read from the release's CUDA wheel, with no engine: no machine of this project can run
an engine of vLLM 0.33 or 0.34 (``docs/vllm-versions.md``).

Each wheel is downloaded once (``pip download --no-deps``, ~250–340 MB, cached in
``~/.cache/hsstream/vllm-wheels``) and its Python files unpacked into a throw-away folder. Its
source is read (``ast``) rather than imported: vLLM's modules import its CUDA parts and the torch
it pins. Only self-contained modules are imported, by path (the speculators loader's
``algos.py``, ``token_buffer.py``). Per version:

* ``abstract_methods``: every abstract method of ``KVConnectorBase_V1`` (and ``SupportsHMA``) is
  implemented by ``HiddenStatesStreamConnector``; ``overrides``: every method of the base we
  define has a compatible signature (same kind: method / classmethod / property; every argument
  the base's callers may pass is accepted; nothing more is required);
* ``hooks``: the hooks and classes we rely on exist (``bind_connector_metadata``, ``get_finished``,
  ``request_finished(_all_groups)``, ``get_required_kvcache_layout``, ``get_finished_count``,
  ``CacheOnlyAttentionLayer``, ``HiddenStateCacheSpec``, ...) and vLLM still calls them where we
  expect (the file that calls each); ``prefer_cross_layer_blocks`` and the optional hooks (sleep
  mode, ``kv_cache_access``) are reported as present or absent, and handled when present;
* ``hook_order``: every runner of ``connector/contract/vllm_hooks.py`` that names this version
  reads, call for call and condition for condition, as the data says (what
  ``tests/unit/connector/test_hook_order.py`` drives), every runner present in the wheel is one of
  them, and the base's hooks our connector inherits do what the data says (nothing, or call
  ``get_finished``);
* ``token_buffer``: where ``Request`` holds ``TokenBuffer``s, vLLM's own class through our
  scheduler side gives plain lists of the same ids (and pickles small);
* ``peagle``: P-EAGLE's serving check (``trainer_client/drafts/peagle.py``) run against this
  version's speculators loader refuses exactly where the loader or the speculative config does;
* ``cpu_fix``: whether ``hsstream/vllm_cpu_fix.py``'s target (``rejection_sampler.
  expand_batch_to_tokens``) is there with the signature it patches.

Writes ``bench/results/vllm_conformance.json`` and exits 1 on any failed check. ``--connector
FILE`` checks another copy of ``connector/vllm_plugin.py`` (a planted mismatch must fail);
``--source DIR`` checks an unpacked vLLM tree (the installed one: ``tests/unit/bench/
test_vllm_conformance.py``) instead of downloading.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import pickle
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from connector.contract import vllm_hooks as H  # noqa: E402

VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
CACHE = Path.home() / ".cache" / "hsstream" / "vllm-wheels"
OUT = ROOT / "bench" / "results" / "vllm_conformance.json"
PLUGIN = ROOT / "connector" / "vllm_plugin.py"
OUR_CLASS = "HiddenStatesStreamConnector"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"

#: The base's methods our connector relies on vLLM to define (what the plug-in calls or overrides).
RELIED_ON = ("__init__", "bind_connector_metadata", "clear_connector_metadata", "register_kv_caches", "get_finished",
             "get_transfer_results",
             "request_finished", "build_connector_meta", "update_state_after_alloc", "get_num_new_matched_tokens",
             "get_required_kvcache_layout", "get_finished_count", "shutdown")  # fmt: skip
#: Where vLLM must still call each hook: a file that calls ``.hook(`` (any of them).
CALLED_IN = {
    "get_finished": [BASE],  # from get_transfer_results, which the runners call (hook_order)
    "request_finished": ["vllm/v1/core/sched/scheduler.py"],
    "request_finished_all_groups": ["vllm/v1/core/sched/scheduler.py"],
    "get_required_kvcache_layout": ["vllm/distributed/kv_transfer/kv_connector/utils.py"],
    "get_finished_count": ["vllm/distributed/kv_transfer/kv_connector/utils.py"],
    "register_kv_caches": ["vllm/v1/worker/gpu/kv_connector.py", "vllm/v1/worker/gpu_model_runner.py",
                           "vllm/v1/worker/kv_connector_model_runner_mixin.py"],
    "build_connector_meta": ["vllm/v1/core/sched/scheduler.py"],
    "update_state_after_alloc": ["vllm/v1/core/sched/scheduler.py"],
    "get_num_new_matched_tokens": ["vllm/v1/core/sched/scheduler.py"],
}  # fmt: skip
#: Optional hooks: handled by our connector where the base has them, and called where vLLM calls them.
OPTIONAL = {
    "unregister_kv_caches": ["vllm/v1/worker/gpu_worker.py"],
    "restore_kv_caches": ["vllm/v1/worker/gpu_worker.py"],
    "supports_sleep_mode": ["vllm/config/vllm.py"],
    "kv_cache_access": ["vllm/distributed/kv_transfer/kv_connector/factory.py"],
}
#: Names our plug-in imports from vLLM: (module file, name, what it must be).
IMPORTS = [
    (BASE, "KVConnectorBase_V1", "class"), (BASE, "KVConnectorMetadata", "class"), (BASE, "KVConnectorRole", "class"),
    (BASE, "SupportsHMA", "class"),
    ("vllm/model_executor/models/extract_hidden_states.py", "CacheOnlyAttentionLayer", "class"),
    ("vllm/v1/kv_cache_interface.py", "HiddenStateCacheSpec", "class"),
    ("vllm/config/__init__.py", "get_layers_from_vllm_config", "name"),
    ("vllm/distributed/parallel_state.py", "get_tensor_model_parallel_rank", "function"),
]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Wheels
# ------------------------------------------------------------------------------------------------


def wheel(version: str, cache: Path = CACHE) -> Path:
    """The CUDA wheel of ``vllm==version`` (x86-64), downloaded once into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    have = sorted(cache.glob(f"vllm-{version}-*x86_64.whl"))
    if have:
        return have[0]
    print(f"downloading vllm {version} (--no-deps) into {cache} ...", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "-d", str(cache),
                        f"vllm=={version}"], capture_output=True, text=True)  # fmt: skip
    have = sorted(cache.glob(f"vllm-{version}-*x86_64.whl"))
    if r.returncode != 0 or not have:
        raise SystemExit(f"pip download vllm=={version} failed:\n{r.stderr[-2000:]}")
    return have[0]


def unpack(whl: Path, dest: Path) -> Path:
    """The wheel's Python files under ``dest`` (``dest/vllm/...``)."""
    with zipfile.ZipFile(whl) as z:
        for m in z.namelist():
            if m.startswith("vllm/") and m.endswith(".py"):
                z.extract(m, dest)
    return dest


# ------------------------------------------------------------------------------------------------
# Reading source
# ------------------------------------------------------------------------------------------------


@functools.cache
def parse(root: Path, rel: str) -> ast.Module | None:
    """``root/rel`` parsed, once per process (vLLM's runner files are thousands of lines)."""
    p = root / rel
    return ast.parse(p.read_text(), str(p)) if p.is_file() else None


def find_def(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST | None = None
    body = tree.body
    for part in qualname.split("."):
        node = next((n for n in _defs(body) if n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def _defs(body: list) -> list:
    """Definitions in a body, including those under a class-level ``if`` (feature checks)."""
    out = []
    for n in body:
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            out.append(n)
        elif isinstance(n, ast.If | ast.Try):
            for part in (n.body, getattr(n, "orelse", []), *[h.body for h in getattr(n, "handlers", [])]):
                out.extend(_defs(part))
    return out


def dotted(e: ast.AST) -> str | None:
    parts = []
    while isinstance(e, ast.Attribute):
        parts.append(e.attr)
        e = e.value
    if isinstance(e, ast.Name):
        return ".".join([e.id, *reversed(parts)])
    return None


def _wanted(name: str, reads: tuple[str, ...]) -> bool:
    return any(name.startswith(r) if r.endswith(".") else name == r for r in reads)


def read_calls(fn: ast.AST, reads: tuple[str, ...]) -> list[H.Call]:
    """The calls (and assignments, yields) of ``fn`` that ``reads`` names, in source order, each
    with the tests of the ``if`` statements around it, as :class:`~connector.contract.vllm_hooks.Call`."""
    out: list[tuple[tuple[int, int], H.Call]] = []

    def visit(node: ast.AST, conds: tuple[str, ...], exits: bool, in_return: bool) -> None:
        if node is not fn and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            return  # a nested function runs when it is called, not here
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            visit(node.test, conds, False, False)
            for branch, c in ((node.body, test), (node.orelse, f"not ({test})")):
                ends = bool(branch) and isinstance(branch[-1], ast.Return | ast.Raise)
                for s in branch:
                    visit(s, (*conds, c), ends, False)
            return
        here = in_return or isinstance(node, ast.Return)
        if isinstance(node, ast.Yield) and H.BODY in reads:
            out.append(((node.lineno, node.col_offset), H.Call(H.BODY, conds)))
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = "=" + node.targets[0].id
            if name in reads:
                out.append(((node.lineno, node.col_offset), H.Call(name, conds, (ast.unparse(node.value),))))
        if isinstance(node, ast.Call):
            d = dotted(node.func)
            if d is not None and _wanted(d, reads):
                kws = tuple(f"{k.arg}={ast.unparse(k.value)}" for k in node.keywords if k.arg)
                out.append(((node.func.lineno, node.func.col_offset), H.Call(d, conds, kws, exits or here)))
        for child in ast.iter_child_nodes(node):
            visit(child, conds, exits, here)

    for s in fn.body:  # type: ignore[attr-defined]
        visit(s, (), False, False)
    return [c for _, c in sorted(out, key=lambda x: x[0])]


# ------------------------------------------------------------------------------------------------
# Signatures
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sig:
    kind: str  # method | classmethod | staticmethod | property
    positional: tuple[tuple[str, bool, bool], ...]  # (name, has default, positional-only), self/cls dropped
    keyword_only: tuple[tuple[str, bool], ...]
    varargs: bool
    varkw: bool
    abstract: bool
    body: str  # "no-op", "calls get_finished", "clears the metadata", or "other"

    def text(self) -> str:
        ps = [n + ("=…" if d else "") for n, d, _ in self.positional]
        ps += ["*args"] if self.varargs else (["*"] if self.keyword_only else [])
        ps += [n + ("=…" if d else "") for n, d in self.keyword_only] + (["**kwargs"] if self.varkw else [])
        return f"{self.kind} ({', '.join(ps)})"


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {dotted(d.func if isinstance(d, ast.Call) else d) or "" for d in fn.decorator_list}


def _body_kind(fn: ast.FunctionDef) -> str:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    calls = {dotted(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    if any(c and c.endswith(".get_finished") for c in calls):
        return "calls get_finished"
    for s in body:
        if isinstance(s, ast.Assign) and any(ast.unparse(t) == "self._connector_metadata" for t in s.targets) \
                and ast.unparse(s.value) == "None":  # fmt: skip
            return "clears the metadata"
    trivial = all(
        isinstance(s, ast.Pass)
        or (isinstance(s, ast.Return) and (s.value is None or isinstance(s.value, ast.Constant | ast.Tuple)
                                           or ast.unparse(s.value) in ("set()", "None", "()", "[]", "{}")))
        or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and dotted(s.value.func) == "logger.debug")
        for s in body
    )  # fmt: skip
    return "no-op" if trivial else "other"


def signature(fn: ast.FunctionDef) -> Sig:
    decos = _decorators(fn)
    kind = ("classmethod" if "classmethod" in decos else "staticmethod" if "staticmethod" in decos
            else "property" if "property" in decos else "method")  # fmt: skip
    a = fn.args
    pos = [(x.arg, False, True) for x in a.posonlyargs] + [(x.arg, False, False) for x in a.args]
    for i in range(len(a.defaults)):
        n, _, po = pos[len(pos) - len(a.defaults) + i]
        pos[len(pos) - len(a.defaults) + i] = (n, True, po)
    if kind != "staticmethod" and pos:
        pos = pos[1:]  # self / cls
    kwo = tuple((x.arg, d is not None) for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True))
    return Sig(kind, tuple(pos), kwo, a.vararg is not None, a.kwarg is not None,
               bool({"abstractmethod", "abc.abstractmethod"} & decos), _body_kind(fn))  # fmt: skip


def class_sigs(tree: ast.Module | None, name: str) -> dict[str, Sig] | None:
    node = find_def(tree, name) if tree is not None else None
    if not isinstance(node, ast.ClassDef):
        return None
    return {f.name: signature(f) for f in _defs(node.body) if isinstance(f, ast.FunctionDef)}


def compatible(ours: Sig, base: Sig) -> str | None:
    """None if every call vLLM may make through ``base``'s signature works on ``ours``; else why not."""
    if ours.kind != base.kind:
        return f"is a {ours.kind}, vLLM's a {base.kind}"
    if base.kind == "property":
        return None
    for i, (name, _, posonly) in enumerate(base.positional):
        if i < len(ours.positional):
            oname = ours.positional[i][0]
            if oname != name and not posonly:
                return f"argument {i + 1} is {oname!r}, vLLM's {name!r} (callers may pass it by name)"
        elif not ours.varargs:
            return f"takes no argument {i + 1} ({name!r})"
        if not posonly and i >= len(ours.positional) and not ours.varkw:
            return f"cannot take {name!r} by name"
    ours_kw = {n for n, _, po in ours.positional if not po} | {n for n, _ in ours.keyword_only}
    for name, _ in base.keyword_only:
        if name not in ours_kw and not ours.varkw:
            return f"takes no keyword argument {name!r}"
    base_names = {n for n, _, _ in base.positional} | {n for n, _ in base.keyword_only}
    for i, (name, default, _) in enumerate(ours.positional):
        if i >= len(base.positional) and not default:
            return f"requires argument {name!r}, which vLLM does not pass"
    for name, default in ours.keyword_only:
        if not default and name not in base_names:
            return f"requires keyword argument {name!r}, which vLLM does not pass"
    if base.varargs and not ours.varargs:
        return "takes no *args, vLLM passes them"
    if base.varkw and not ours.varkw:
        return "takes no **kwargs, vLLM passes them"
    return None


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


def _check(name: str, ok: bool, detail: object) -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail}


def check_signatures(root: Path, plugin: Path) -> list[dict]:
    base_tree = parse(root, BASE)
    base = class_sigs(base_tree, "KVConnectorBase_V1") or {}
    hma = class_sigs(base_tree, "SupportsHMA") or {}
    ours = class_sigs(ast.parse(plugin.read_text()), OUR_CLASS) or {}
    abstract = {n: s for n, s in {**base, **hma}.items() if s.abstract}
    bad_abs = {}
    for n, s in abstract.items():
        if n not in ours:
            bad_abs[n] = "not implemented"
        elif (why := compatible(ours[n], s)) is not None:
            bad_abs[n] = f"{ours[n].text()} vs vLLM's {s.text()}: {why}"
    bad_over = {}
    for n, s in ours.items():
        b = base.get(n) or hma.get(n)
        if b is not None and (why := compatible(s, b)) is not None:
            bad_over[n] = f"{s.text()} vs vLLM's {b.text()}: {why}"
    missing = [n for n in RELIED_ON if n not in base]
    if "request_finished_all_groups" not in hma:
        missing.append("SupportsHMA.request_finished_all_groups")
    return [
        _check("abstract_methods", not bad_abs, {"abstract": sorted(abstract), "failures": bad_abs}),
        _check("overrides", not bad_over, {"overridden": sorted(n for n in ours if n in base or n in hma),
                                           "failures": bad_over}),  # fmt: skip
        _check("base_defines_what_we_use", not missing, {"missing": missing}),
    ]


def _callers(root: Path, files: list[str], hook: str) -> list[str]:
    """``file:function`` of each call ``X.hook(...)`` in ``files``."""
    out = []
    for rel in files:
        p = root / rel
        if not p.is_file() or f".{hook}(" not in p.read_text():
            continue
        tree = parse(root, rel)
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                for n in ast.walk(fn):
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == hook:
                        out.append(f"{rel}:{fn.name}")
    return sorted(set(out))


@functools.cache
def _referenced(root: Path, name: str) -> list[str]:
    """Files under vllm/ whose text names ``name``."""
    return sorted(str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py") if name in p.read_text(errors="replace"))


def check_hooks(root: Path, plugin: Path) -> list[dict]:
    base = class_sigs(parse(root, BASE), "KVConnectorBase_V1") or {}
    ours = class_sigs(ast.parse(plugin.read_text()), OUR_CLASS) or {}
    called = {h: _callers(root, files, h) for h, files in CALLED_IN.items()}
    not_called = sorted(h for h, sites in called.items() if not sites)
    imports = {}
    for rel, name, what in IMPORTS:
        tree = parse(root, rel)
        if tree is None:
            imports[name] = f"missing: {rel}"
            continue
        defined = {n.name: n for n in _defs(tree.body)}
        names = set(defined) | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        ok = name in names and (what == "name" or isinstance(defined.get(name), ast.ClassDef if what == "class" else ast.FunctionDef))
        imports[name] = f"{rel}: ok" if ok else f"{rel}: no {what} {name}"
    optional = {}
    bad_optional = {}
    for h, files in OPTIONAL.items():
        if h not in base:
            optional[h] = "absent (nothing to handle)"
            continue
        sites = _callers(root, files, h)
        optional[h] = {"ours": ours[h].text() if h in ours else None, "called_in": sites}
        if h not in ours:
            bad_optional[h] = "vLLM has it and our connector does not handle it"
        elif not sites:
            bad_optional[h] = f"not called in {files}"
    # prefer_cross_layer_blocks: ours must stay False where vLLM reads it; where nothing reads it, it is inert
    if "prefer_cross_layer_blocks" in base:
        cross = {"status": "in the base", "ours": ours.get("prefer_cross_layer_blocks") and ours["prefer_cross_layer_blocks"].text()}
        cross_ok = "prefer_cross_layer_blocks" in ours and ours["prefer_cross_layer_blocks"].kind == base["prefer_cross_layer_blocks"].kind
    else:
        refs = _referenced(root, "prefer_cross_layer_blocks")
        cross = {"status": "absent: vLLM never reads it, our property is inert" if not refs else "read outside the base",
                 "referenced_in": refs}  # fmt: skip
        cross_ok = not refs
    return [
        _check("hooks_called", not not_called, {"called_in": called, "not_called": not_called}),
        _check("imports", all(v.endswith(": ok") for v in imports.values()), imports),
        _check("optional_hooks", not bad_optional, {"hooks": optional, "failures": bad_optional}),
        _check("prefer_cross_layer_blocks", cross_ok, cross),
    ]


def check_hook_order(root: Path, version: str, plugin: Path) -> list[dict]:
    out = []
    runners = [r for r in H.RUNNERS if version in r.versions]
    for r in runners:
        diffs = {}
        for fn in r.fns:
            tree = parse(root, fn.file)
            node = find_def(tree, fn.qualname) if tree is not None else None
            if node is None:
                diffs[fn.qualname] = f"not found in {fn.file}"
                continue
            got = read_calls(node, fn.reads)
            if got != list(fn.calls):
                diffs[fn.qualname] = {"read": [_call_json(c) for c in got], "data": [_call_json(c) for c in fn.calls]}
        steps = {p: H.step(r, p) for p in r.paths}
        out.append(_check(f"hook_order:{r.name}", not diffs, {"file_functions": len(r.fns), "differences": diffs,
                                                             "steps": steps}))  # fmt: skip
    # every runner this wheel has is covered by the data for this version
    families = {"v1": "vllm/v1/worker/kv_connector_model_runner_mixin.py", "v2": "vllm/v1/worker/gpu/kv_connector.py"}
    covered = {r.name.split("-")[0] for r in runners}
    uncovered = [f for f, path in families.items() if (root / path).is_file() and f not in covered]
    out.append(_check("hook_order:runners_covered", not uncovered,
                      {"present": [f for f, p in families.items() if (root / p).is_file()], "uncovered": uncovered}))  # fmt: skip
    base = class_sigs(parse(root, BASE), "KVConnectorBase_V1") or {}
    ours = class_sigs(ast.parse(plugin.read_text()), OUR_CLASS) or {}
    inherited = {}
    for hook, want in H.INHERITED_HOOKS.items():
        if hook in ours:
            inherited[hook] = "ours"
        elif hook not in base:
            inherited[hook] = "absent"
        else:
            inherited[hook] = base[hook].body
    bad = {h: v for h, v in inherited.items() if v not in ("ours", H.INHERITED_HOOKS[h])}
    out.append(_check("inherited_hooks", not bad, {"bodies": inherited, "failures": bad}))
    return out


def _call_json(c: H.Call) -> list:
    return [c.name, list(c.conditions), list(c.keywords), c.exits]


def _load_by_path(name: str, path: Path, extra: dict[str, types.ModuleType] | None = None) -> types.ModuleType:
    """A module of the wheel imported alone, its imports of ``extra`` answered by the modules given."""
    saved = {k: sys.modules.get(k) for k in (extra or {})}
    sys.modules.update(extra or {})
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def check_token_buffer(root: Path) -> dict:
    p = root / "vllm/v1/token_buffer.py"
    if not p.is_file():
        return _check("token_buffer", True, "no TokenBuffer: requests hold lists")
    from connector.scheduler_side import SchedulerSide

    cu = _load_by_path("_hsstream_vllm_collection_utils", root / "vllm/utils/collection_utils.py")
    tb = _load_by_path("_hsstream_vllm_token_buffer", p, {"vllm.utils.collection_utils": cu})
    prompt, out = [11, 12, 13, 14, 15], [90, 91]
    buf = tb.TokenBuffer(prompt)
    allb = tb.TokenBuffer(prompt + out)
    const = getattr(cu, "ConstantList", lambda x: x)
    side = SchedulerSide("/nonexistent-spool", use_lock=False)
    got = {}
    for params, want in (({}, prompt), ({"include_output_tokens": True}, prompt + out[:-1])):
        req = SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=buf,
                              all_token_ids=const(allb), num_computed_tokens=len(prompt + out))  # fmt: skip
        ok, _ = side.request_finished(req, [0, 1])
        (ps,) = side.take_pending()
        ids = ps.token_ids
        got[str(bool(params))] = {
            "saved": ok, "type": type(ids).__name__, "equal": ids == want,
            "plain_ints": all(type(i) is int for i in ids), "pickle_bytes": len(pickle.dumps(ps)),
        }  # fmt: skip
    ok = all(g["saved"] and g["type"] == "list" and g["equal"] and g["plain_ints"] for g in got.values())
    return _check("token_buffer", ok, {"prompt_only": got["False"], "include_output_tokens": got["True"],
                                       "class": "vllm.v1.token_buffer.TokenBuffer (array('i'))"})  # fmt: skip


def check_peagle(root: Path, version: str) -> dict:
    from trainer_client.drafts import peagle

    algos = _load_by_path("_hsstream_vllm_speculators_algos", root / "vllm/transformers_utils/configs/speculators/algos.py")
    spec_src = (root / "vllm/config/speculative.py").read_text()
    config_refuses = "parallel_drafting is only supported by the dflash and dspark" in spec_src
    fn = algos.SUPPORTED_SPECULATORS_TYPES.get("peagle")
    try:
        if fn is None:
            raise ValueError("no peagle entry")
        fn({"mask_token_id": 0, "draft_vocab_size": 8}, {"model_type": "llama"})
        loader_refuses = None
    except (ValueError, KeyError) as e:
        loader_refuses = str(e)
    ours = peagle.vllm_refusal(algos=algos, version=version)
    want_refused = bool(loader_refuses) or config_refuses
    return _check("peagle", (ours is not None) == want_refused,
                  {"loader_refuses": loader_refuses, "speculative_config_refuses_parallel_eagle3": config_refuses,
                   "ours": ours or "served as {\"method\": \"eagle3\", \"parallel_drafting\": true}"})  # fmt: skip


def check_cpu_fix(root: Path) -> dict:
    from hsstream import vllm_cpu_fix as F

    rel = F.TARGET_MODULE.replace(".", "/") + ".py"
    tree = parse(root, rel)
    if tree is None:
        return _check("cpu_fix", True, f"{rel} absent: the plugin patches nothing there and says so once "
                                       "(tests/unit/hsstream/test_trainer_vllm_cpu_fix.py)")  # fmt: skip
    fn = find_def(tree, F.TARGET_FUNCTION)
    params = [a.arg for a in fn.args.args] if isinstance(fn, ast.FunctionDef) else None
    ok = params is not None and params[:5] == list(F.TARGET_PARAMS)
    return _check("cpu_fix", ok, {"target": f"{rel}:{F.TARGET_FUNCTION}", "params": params})


_IMPORT_PROBE = """
import inspect, json, sys
sys.path.insert(0, sys.argv[1])
from vllm.distributed.kv_transfer.kv_connector.v1 import base
cls = base.KVConnectorBase_V1
out = {"file": base.__file__, "abstract": sorted(cls.__abstractmethods__), "params": {}}
for name, fn in vars(cls).items():
    fn = getattr(fn, "__func__", getattr(fn, "fget", fn))
    if callable(fn):
        out["params"][name] = [p for p in inspect.signature(fn).parameters][1:]
print(json.dumps(out))
"""


def check_by_import(root: Path, timeout_s: float = 900) -> dict:
    """Where the wheel's connector base imports without its CUDA parts (with this venv's torch),
    what Python itself says of it must be what the source was read as: its abstract methods and
    every method's parameters. A base that does not import here is read from source only."""
    try:
        r = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(root)], capture_output=True, text=True,
                           timeout=timeout_s, cwd=tempfile.gettempdir())  # fmt: skip
    except subprocess.TimeoutExpired:
        return _check("by_import", True, f"not imported within {timeout_s:.0f} s: read from source only")
    if r.returncode != 0:
        return _check("by_import", True, f"does not import here ({r.stderr.strip().splitlines()[-1:]}): read from source only")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if not got["file"].startswith(str(root)):
        return _check("by_import", False, f"imported {got['file']}, not the wheel's")
    sigs = class_sigs(parse(root, BASE), "KVConnectorBase_V1") or {}
    read_abstract = sorted(n for n, sg in sigs.items() if sg.abstract)
    differ = {n: {"imported": ps, "read": [x for x, _, _ in sigs[n].positional] + [x for x, _ in sigs[n].keyword_only]}
              for n, ps in got["params"].items() if n in sigs and sigs[n].kind != "property"
              and [p for p in ps if p not in ("args", "kwargs")] !=
              [x for x, _, _ in sigs[n].positional] + [x for x, _ in sigs[n].keyword_only]}  # fmt: skip
    ok = got["abstract"] == read_abstract and not differ
    return _check("by_import", ok, {"abstract": got["abstract"], "read_as": read_abstract, "differences": differ,
                                    "methods": len(got["params"])})  # fmt: skip


def check_version(root: Path, version: str, plugin: Path = PLUGIN, *, by_import: bool = True) -> dict:
    t0 = time.perf_counter()
    checks = [*check_signatures(root, plugin), *check_hooks(root, plugin), *check_hook_order(root, version, plugin),
              check_token_buffer(root), check_peagle(root, version), check_cpu_fix(root)]  # fmt: skip
    if by_import:
        checks.append(check_by_import(root))
    return {"version": version, "ok": all(c["ok"] for c in checks), "checks": checks,
            "read_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def source_version(root: Path) -> str:
    """``0.32.0`` for a tree whose ``vllm/_version.py`` says ``0.32.0+cpu`` (the CPU build is the same code)."""
    import re

    m = re.search(r"""^__version__\b.*=\s*['"]([^'"]+)['"]""", (root / "vllm/_version.py").read_text(), re.M)
    if m is None:
        raise ValueError(f"no version in {root}/vllm/_version.py")
    return m.group(1).split("+")[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=list(VERSIONS))
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the wheels are kept between runs")
    ap.add_argument("--connector", type=Path, default=PLUGIN, help="the connector source to check")
    ap.add_argument("--source", type=Path, help="check this unpacked vLLM tree (DIR/vllm/...) instead")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-import", action="store_true", help="read the source only (skip the import cross-check)")
    a = ap.parse_args(argv)
    results = []
    if a.source:
        results.append(check_version(a.source, source_version(a.source), a.connector, by_import=not a.no_import))
    else:
        for v in a.versions:
            whl = wheel(v, a.cache)
            with tempfile.TemporaryDirectory(prefix=f"vllm-{v}-") as d:
                r = check_version(unpack(whl, Path(d)), v, a.connector, by_import=not a.no_import)
                results.append({**r, "wheel": whl.name})
    for r in results:
        print(f"vLLM {r['version']}: {'pass' if r['ok'] else 'FAIL'}")
        for c in r["checks"]:
            line = f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}"
            if not c["ok"]:
                line += f": {json.dumps(c['detail'])[:600]}"
            print(line)
    doc = {"generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "connector": str(a.connector),
           "ok": all(r["ok"] for r in results), "versions": results}  # fmt: skip
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
