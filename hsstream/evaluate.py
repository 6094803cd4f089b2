"""Serve the verifier with a draft in vLLM and measure acceptance (``hsstream eval``). How vLLM
serves a draft directory, and whether the installed vLLM can, is the draft's own plug-in's
(``trainer_client/drafts/serving.py``).

One vLLM engine per child process (its memory goes back when the child exits); the child runs
``python -m hsstream.evaluate --serve-child IN OUT``. bench/served_acceptance/acceptance.py serves through here too.

Two independent sources of the same figures, per temperature:

* **ours**, from each request's own record: vLLM (``per_request_spec_decode_metrics="detailed"``)
  returns with every finished sequence the ordered accepted / proposed draft counts of each of
  its verify steps (``CompletionOutput.spec_decode_metrics``); we sum them over the requests;
* **vLLM's counters**, the ``vllm:spec_decode_*`` Prometheus counters (what ``/metrics`` serves;
  offline they are read with ``LLM.get_metrics()``), after minus before.

With vLLM's definitions (vllm/v1/spec_decode/metrics.py): a *draft* is one verify step that
proposed tokens; acceptance rate = accepted / drafted tokens; per-position acceptance rate ``i``
= drafts whose first ``i+1`` tokens were all accepted / drafts; mean acceptance length = tokens
emitted per verify step = 1 + accepted / drafts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from trainer_client.drafts.serving import DraftError, check_draft_dir, speculative_config  # noqa: F401 - the CLI's

SPEC_TOKENS = 3


def draft_verifier(draft: str | Path) -> str | None:
    """The verifier the draft was trained against (its config's ``speculators_config.verifier.
    name_or_path``), if that is a directory here; None otherwise (a hub name, another host's path)."""
    try:
        c = json.loads((Path(draft) / "config.json").read_text())
        p = ((c.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return str(p) if isinstance(p, str) and p and Path(p).is_dir() else None


# --------------------------------------------------------------------------------------------
# In the child: one engine
# --------------------------------------------------------------------------------------------


def counter_total(metrics, name: str) -> float:  # noqa: ANN001
    return sum(float(m.value) for m in metrics if m.name == name and hasattr(m, "value"))


def per_position_totals(metrics, name: str) -> list[float]:  # noqa: ANN001
    for m in metrics:
        if m.name == name and hasattr(m, "values"):
            return [float(v) for v in m.values]
    return []


def per_request_figures(spec_metrics: list, k: int) -> dict:  # noqa: ANN001
    """Our figures from the requests' per-step records (``RequestSpecDecodeMetrics`` or their
    ``to_dict()``): drafts, drafted, accepted, accepted per position."""
    drafts = drafted = accepted = 0
    per_pos = [0] * k
    for m in spec_metrics:
        if m is None:
            continue
        steps_a = m["per_step_accepted"] if isinstance(m, dict) else m.per_step_accepted
        steps_d = m["per_step_drafted"] if isinstance(m, dict) else m.per_step_drafted
        for a, d in zip(steps_a, steps_d):
            if d <= 0:  # vLLM counts a draft only where tokens were proposed
                continue
            drafts += 1
            drafted += d
            accepted += a
            for i in range(a):
                per_pos[i] += 1
    return {"drafts": drafts, "drafted": drafted, "accepted": accepted, "accepted_per_position": per_pos}


def counter_deltas(before, after) -> tuple[float, float, float, list[float] | None]:  # noqa: ANN001
    """vLLM's counters after minus before: drafts, drafted and accepted tokens, accepted per position (or None)."""
    d = [counter_total(after, f"vllm:spec_decode_num_{k}") - counter_total(before, f"vllm:spec_decode_num_{k}")
         for k in ("drafts", "draft_tokens", "accepted_tokens")]  # fmt: skip
    pos_b = per_position_totals(before, "vllm:spec_decode_num_accepted_tokens_per_pos")
    pos_a = per_position_totals(after, "vllm:spec_decode_num_accepted_tokens_per_pos")
    return d[0], d[1], d[2], ([a - b for a, b in zip(pos_a, pos_b + [0.0] * len(pos_a))] if pos_a else None)


def summarise(drafts: float, drafted: float, accepted: float, per_pos: list[float] | None) -> dict:
    """vLLM's derived figures from raw counts."""
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_position": [p / drafts for p in per_pos] if drafts and per_pos else None,
    }


def has_request_records() -> bool:
    """Whether the installed vLLM keeps each request's spec-decode record
    (``per_request_spec_decode_metrics``, an engine argument since after vLLM 0.26): without it
    only vLLM's counters measure acceptance, and ``ours`` is None. A feature check, not a version's."""
    from vllm.engine.arg_utils import EngineArgs

    return "per_request_spec_decode_metrics" in getattr(EngineArgs, "__dataclass_fields__", {})


def serve_and_measure(verifier: str, draft: str | None, prompts: list[str] | list[list[int]], max_tokens: int, temps: list[float],
                      spec_tokens: int = SPEC_TOKENS, per_request: bool = False, max_model_len: int = 1024,
                      spec: dict | None = None, dtype: str = "auto") -> dict:  # fmt: skip
    """Acceptance of ``draft`` under ``verifier`` in vLLM, per temperature (child-process body).

    ``per_request`` adds each temperature's ``ours`` (from the requests' own records) and
    ``vllm_metrics`` (from the counters) figures, and ``tokens_per_s``. ``dtype``: vLLM's
    ``--dtype`` for the verifier (auto: its checkpoint's)."""
    from vllm import LLM, SamplingParams

    if draft and spec is None:
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": spec_tokens}
    spec = {**spec, "model": draft, "num_speculative_tokens": spec_tokens} if draft else None
    records = per_request and draft and has_request_records()
    extra = {"per_request_spec_decode_metrics": "detailed"} if records else {}
    llm = LLM(
        model=verifier, speculative_config=spec, disable_log_stats=False, max_model_len=max_model_len, enforce_eager=True,
        gpu_memory_utilization=0.2, seed=0, max_num_seqs=16, dtype=dtype, **extra,
    )  # fmt: skip
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]  # text or token ids
    # One short request first, so that tokens/s does not include the engine's first-batch warm-up
    # (the first temperature measured would be slower than the others); the spec-decode figures
    # are differences of counters around each batch, so it counts in none of them.
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    out = {}
    for temp in temps:
        before = llm.get_metrics()
        params = [
            SamplingParams(temperature=temp, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
            for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        res = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.get_metrics()

        drafts, drafted, accepted, per_pos = counter_deltas(before, after)
        gen = sum(len(r.outputs[0].token_ids) for r in res)
        o = {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_per_position": per_pos,
            "generated_tokens": gen,
            "wall_s": round(wall, 2),
            "sample_text": res[0].outputs[0].text[:160],
        }
        if per_request:
            o["tokens_per_s"] = gen / wall if wall else None
            if draft:
                o["vllm_metrics"] = {"drafts": drafts, "drafted": drafted, "accepted": accepted,
                                     "accepted_per_position": per_pos, **summarise(drafts, drafted, accepted, per_pos)}  # fmt: skip
                if records:
                    ours = per_request_figures([r.outputs[0].spec_decode_metrics for r in res], spec_tokens)
                    missing = sum(r.outputs[0].spec_decode_metrics is None for r in res)
                    o["ours"] = {**ours, **summarise(ours["drafts"], ours["drafted"], ours["accepted"],
                                                     ours["accepted_per_position"]), "requests_without_record": missing}  # fmt: skip
                else:  # this vLLM keeps no per-request record: its counters are the only figures
                    o["ours"] = None
        out[str(temp)] = o
    return out


# --------------------------------------------------------------------------------------------
# In the parent
# --------------------------------------------------------------------------------------------


def run_serving(verifier: str, draft: str | None, prompts: list[str], max_tokens: int, temps: list[float],
                workdir: Path, name: str, fix: bool = True, *, spec_tokens: int = SPEC_TOKENS,
                per_request: bool = False, max_model_len: int = 1024, timeout_s: float = 1800,
                spec: dict | None = None, dtype: str = "auto") -> dict:  # fmt: skip
    """:func:`serve_and_measure` in a child process (log: WORKDIR/NAME.log); raises RuntimeError
    with the log's tail if the child fails."""
    from hsstream import launch

    if dtype == "auto":  # vLLM's CPU build on a CPU without bf16 instructions: float32 (launch.cpu_serving_dtype)
        dtype = launch.cpu_serving_dtype(verifier) or "auto"
    workdir = Path(workdir)
    spec = {"verifier": verifier, "draft": draft, "prompts": prompts, "max_tokens": max_tokens, "temps": temps,
            "spec_tokens": spec_tokens, "per_request": per_request, "max_model_len": max_model_len,
            **({"spec": spec} if spec else {}), **({"dtype": dtype} if dtype != "auto" else {})}  # fmt: skip
    t0 = time.perf_counter()
    res, text = run_child(spec, workdir, name, fix=fix, timeout_s=timeout_s, with_log=True)
    res["engine_wall_s"] = round(time.perf_counter() - t0, 1)
    res["cpu_fix_patched_processes"] = text.count("patched vllm rejection_sampler.expand_batch_to_tokens")
    return res


def run_child(spec: dict, workdir: Path, name: str, *, fix: bool = True, timeout_s: float = 1800,
               with_log: bool = False, module: str = "hsstream.evaluate"):  # noqa: ANN202
    """``python -m MODULE --serve-child`` on ``spec`` (log: WORKDIR/NAME.log): its result (and the
    log's text); RuntimeError with the log's tail if the child fails."""
    from hsstream import launch

    (workdir / f"{name}.in.json").write_text(json.dumps(spec))
    env = launch.child_env({"HSSTREAM_VLLM_CPU_FIX": "1" if fix else "0"})
    logf = workdir / f"{name}.log"
    with open(logf, "wb") as fh:
        p = subprocess.run(
            [sys.executable, "-m", module, "--serve-child", str(workdir / f"{name}.in.json"),
             str(workdir / f"{name}.out.json")],
            env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=launch.repo_root(), timeout=timeout_s,
        )  # fmt: skip
    text = logf.read_text(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"vLLM serving run {name} failed ({p.returncode}):\n" + "\n".join(text.splitlines()[-40:]))
    res = json.loads((workdir / f"{name}.out.json").read_text())
    return (res, text) if with_log else res


def is_plain_text(path: str | Path) -> bool:
    """A prompts file of the old kind: a text file whose first line is no JSON object (one
    prompt a line, :func:`read_prompts`); anything else is a source of samples (:func:`source_prompts`)."""
    from trainer_client import data_sources as DS

    if DS.source_kind(path) != "jsonl":
        return False
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                return not line.lstrip().startswith("{")
    return True


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL of ``{"prompt": ...}`` (the REST samples' prompt field) or plain
    text, one prompt a line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{n}: no string 'prompt' field")
            out.append(row["prompt"])
        else:
            out.append(line)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def parse_rows(spec: str | None) -> tuple[int, int | None] | None:
    """``--rows START:STOP`` (0-based, STOP excluded; either may be left out) as a pair."""
    if spec is None:
        return None
    a, sep, b = spec.partition(":")
    try:
        lo, hi = int(a or 0), (int(b) if b.strip() else None)
    except ValueError:
        lo = hi = -1
    if not sep or lo < 0 or (hi is not None and hi <= lo):
        raise ValueError(f"--rows {spec!r}: START:STOP with 0 <= START < STOP, e.g. 17000:17100 (STOP may be left out)")
    return lo, hi


def read_digests(path: str | Path) -> set[str]:
    """``--row-hashes FILE``: one row digest a line (``trainer_client.data_sources.row_digest``)."""
    out = {ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    if not out:
        raise ValueError(f"--row-hashes {path}: no digest in it")
    return out


def chat_prompt_ids(tok, sample: dict, chat_template_kwargs: dict | None = None) -> list[int]:  # noqa: ANN001
    """A chat row's prompt as vLLM would be asked to answer it: its messages (a ShareGPT row
    mapped and repaired as the sidecar does) up to its first assistant turn, rendered with the
    generation prompt (the sidecar's regenerate mode renders a prompt so)."""
    from connector.contract.sample_tokens import SampleRefused, encode_sample, sample_messages

    msgs = sample_messages(sample)
    first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
    if not any(m.get("role") == "user" for m in msgs[:first]):
        raise SampleRefused("no user turn before the first reply", reason="no user turn")
    row = {"messages": msgs[:first], **({"tools": sample["tools"]} if sample.get("tools") is not None else {})}
    ids, _ = encode_sample(tok, row, mode="regenerate", chat_template_kwargs=chat_template_kwargs)
    return ids


def source_prompts(source: str, verifier: str, *, preset: str | None = None, fields: list[str] | None = None,
                   split: str | None = None, rows: str | None = None, row_hashes: str | None = None,
                   limit: int = 32, max_prompt_tokens: int | None = None,
                   chat_template_kwargs: dict | None = None) -> tuple[list[str | list[int]], dict]:  # fmt: skip
    """Prompts from a file or dataset read as ``hsstream submit`` reads it
    (``trainer_client/data_sources.py``: any format, ``preset`` / ``fields`` / ``split``, a JSON
    array cut off before its end), so held-out rows of a training set are named by where they
    are: ``rows`` (``START:STOP``, indexes of the source's rows) and/or ``row_hashes`` (a file of
    ``row_digest`` lines). Each selected row gives one prompt -- a ``prompt`` its text, a chat
    row its conversation up to the first reply (:func:`chat_prompt_ids`), ``token_ids`` their
    first half -- until ``limit``; rows that give none (an empty conversation) are counted, not
    fatal. Returns the prompts and what was read (rows, digests, skipped per reason)."""
    from collections import Counter

    from connector.contract.sample_tokens import SampleRefused, load_tokenizer
    from trainer_client import data_sources as DS

    span = parse_rows(rows)
    want = read_digests(row_hashes) if row_hashes else None
    notes: list[str] = []
    it = DS.iter_samples(source, preset=preset, fields=fields, split=split,
                         on_truncated=lambda t: notes.append(t.line()))  # fmt: skip
    tok = None
    prompts: list[str | list[int]] = []
    used: list[dict] = []
    skipped: Counter[str] = Counter()
    for i, smp in enumerate(it):
        if span is not None and (i < span[0] or (span[1] is not None and i >= span[1])):
            if span[1] is not None and i >= span[1]:
                break
            continue
        digest = DS.row_digest(smp)
        if want is not None and digest not in want:
            continue
        try:
            if isinstance(smp.get("prompt"), str) and smp.get("messages") is None and smp.get("conversations") is None:
                p: str | list[int] = smp["prompt"]
                if not p:
                    raise SampleRefused("empty prompt")
            elif smp.get("token_ids") is not None:
                ids = [int(t) for t in smp["token_ids"]]
                p = ids[: max(1, len(ids) // 2)]
            else:
                tok = tok or load_tokenizer(verifier)
                p = chat_prompt_ids(tok, smp, chat_template_kwargs)
        except SampleRefused as e:
            skipped[e.reason] += 1
            continue
        if max_prompt_tokens is not None and not isinstance(p, str):
            p = p[-max_prompt_tokens:]
        prompts.append(p)
        used.append({"row": i, "id": smp.get("id"), "digest": digest})
        if len(prompts) >= limit:
            break
    if not prompts:
        why = ", ".join(f"{k}: {n}" for k, n in skipped.items()) or "none matched"
        raise ValueError(f"{source}: no prompt in the rows selected ({why})")
    info = {"source": str(source), "rows": rows, "row_hashes": row_hashes, "prompts": len(prompts),
            "skipped": dict(skipped), "used": used, "notes": notes}  # fmt: skip
    return prompts, info


def sample_prompt(token_ids: list[int], loss_mask: list[int] | None, prompt_len: int | None) -> list[int]:
    """What a held-out training sample prompts vLLM with: the tokens before its first trained
    position (a chat sample's conversation up to the reply), a regenerated sample's prompt, or,
    for a sample trained on every position (plain text), its first half."""
    if prompt_len is not None and prompt_len > 0:
        return token_ids[:prompt_len]
    first = next((i for i, m in enumerate(loss_mask or []) if m), 0)
    return token_ids[:first] if first > 0 else token_ids[: max(1, len(token_ids) // 2)]


def job_prompts(client, job: str, fraction: float, seed: int = 0, *, limit: int = 32,  # noqa: ANN001
                max_prompt_tokens: int | None = None) -> tuple[list[list[int]], dict]:
    """Token-id prompts from the samples of ``job`` that ``hsstream train --eval-fraction
    FRACTION --eval-seed SEED`` held out (connector/contract/holdout.py: the same rule), the
    first ``limit`` in index order, each cut to its last ``max_prompt_tokens``; and what was
    read (for the report). ``client``: a :class:`~connector.contract.rest_client.SidecarClient`.
    The sidecar picks them (only held-out samples cross the wire, a page at a time); each is
    checked against the rule here too. Stops once ``limit`` prompts are found."""
    from connector.contract.holdout import check_fraction, held_out, sample_identity

    check_fraction(fraction)
    if fraction <= 0:
        raise ValueError("--eval-fraction must be > 0 with --job (the share `hsstream train --eval-fraction` held out)")
    prompts: list[list[int]] = []
    picked = 0
    for smp in client.iter_job_samples(job, eval_fraction=fraction, eval_seed=seed):  # the sidecar picks
        if not held_out(sample_identity(smp.id, smp.index), fraction, seed):  # the same rule, checked here
            raise ValueError(f"job {job}: the sidecar returned sample {smp.index}, which --eval-fraction "
                             f"{fraction} --eval-seed {seed} does not hold out (another hsstream version?)")  # fmt: skip
        picked += 1
        p = sample_prompt(smp.token_ids, smp.loss_mask, smp.prompt_len)
        if max_prompt_tokens is not None:
            p = p[-max_prompt_tokens:]
        prompts.append(p)
        if len(prompts) >= limit:
            break
    if not prompts:
        n = client.job_samples(job, limit=1).num_samples
        raise ValueError(f"job {job}: none of its {n} samples is held out at --eval-fraction {fraction} "
                         f"--eval-seed {seed}: a larger fraction, or the seed the run trained with")  # fmt: skip
    return prompts, {"job": job, "eval_fraction": fraction, "eval_seed": seed, "held_out_read": picked}


def evaluate(verifier: str, draft: str, prompts: list[str] | list[list[int]], *, max_tokens: int = 64, temps: list[float] | None = None,
             spec_tokens: int | None = None, baseline: bool = True, workdir: Path, max_model_len: int = 1024,
             dtype: str = "auto") -> dict:  # fmt: skip
    """``hsstream eval``'s result: per temperature our figures, vLLM's counters' and tokens/s with
    and without the draft. ``spec_tokens`` None: the draft's own (see :func:`speculative_config`);
    ``dtype``: vLLM's for the verifier."""
    temps = temps or [0.0]
    spec = speculative_config(draft, spec_tokens)
    d, spec_tokens = spec["model"], spec["num_speculative_tokens"]
    res = {"verifier": verifier, "draft": d, "method": spec["method"], "speculative_config": spec,
           "num_speculative_tokens": spec_tokens, "prompts": len(prompts), "max_tokens": max_tokens,
           "dtype": dtype, "temperatures": {}}  # fmt: skip
    with_draft = run_serving(verifier, d, prompts, max_tokens, temps, workdir, "with-draft", spec_tokens=spec_tokens,
                             per_request=True, max_model_len=max_model_len, spec=spec, dtype=dtype)  # fmt: skip
    without = (run_serving(verifier, None, prompts, max_tokens, temps, workdir, "without-draft", per_request=True,
                           max_model_len=max_model_len, dtype=dtype) if baseline else None)  # fmt: skip
    for t in temps:
        w = with_draft[str(t)]
        ours, vm = w["ours"], w["vllm_metrics"]
        res["temperatures"][str(t)] = {
            "ours": ours,
            "vllm_metrics": vm,
            "tokens_per_s": {"with_draft": w["tokens_per_s"], "without_draft": without[str(t)]["tokens_per_s"] if without else None},
            "generated_tokens": w["generated_tokens"],
        }
    res["engine_wall_s"] = {"with_draft": with_draft["engine_wall_s"], **({"without_draft": without["engine_wall_s"]} if without else {})}
    return res


def agreement(res: dict) -> float:
    """The largest gap, over temperatures and figures (rate, per position), between ours and
    vLLM's counters'."""
    gap = 0.0
    for v in res["temperatures"].values():
        o, m = v["ours"], v["vllm_metrics"]
        if o is None:  # this vLLM keeps no per-request record: nothing to compare
            return float("inf")
        pairs = [(o["acceptance_rate"], m["acceptance_rate"])]
        pairs += list(zip(o["acceptance_per_position"] or [], m["acceptance_per_position"] or []))
        if (o["acceptance_per_position"] is None) != (m["acceptance_per_position"] is None):
            return float("inf")
        for a, b in pairs:
            if (a is None) != (b is None):
                return float("inf")
            if a is not None:
                gap = max(gap, abs(a - b))
    return gap


def print_table(res: dict, console=None) -> None:  # noqa: ANN001
    """``hsstream eval``'s table: per temperature, ours beside vLLM's counters, and tokens/s."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    def f(x: float | None, nd: int = 3) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    k = res["num_speculative_tokens"]
    for t, v in res["temperatures"].items():
        o, m, tps = v["ours"], v["vllm_metrics"], v["tokens_per_s"]
        if o is None:  # this vLLM keeps no per-request record (has_request_records): a column of dashes
            o = {"acceptance_per_position": None, "acceptance_rate": None, "mean_acceptance_length": None,
                 "drafts": float("nan")}  # fmt: skip
        tab = Table(title=f"draft {res['draft']}  T={t}  {res['prompts']} prompts x {res['max_tokens']} tokens, k={k}")
        tab.add_column("figure")
        tab.add_column("ours (per request)", justify="right")
        tab.add_column("vLLM /metrics", justify="right")
        for i in range(k):
            a = (o["acceptance_per_position"] or [None] * k)[i]
            b = (m["acceptance_per_position"] or [None] * k)[i]
            tab.add_row(f"acceptance at position {i + 1}", f(a), f(b))
        tab.add_row("acceptance rate (accepted / drafted)", f(o["acceptance_rate"]), f(m["acceptance_rate"]))
        tab.add_row("mean acceptance length (tokens / step)", f(o["mean_acceptance_length"]), f(m["mean_acceptance_length"]))
        tab.add_row("drafts (verify steps with a draft)", f"{o['drafts']:.0f}", f"{m['drafts']:.0f}")
        tab.add_row("tokens/s with the draft", f(tps["with_draft"], 1), "")
        tab.add_row("tokens/s without the draft", f(tps["without_draft"], 1), "")
        console.print(tab)


def serve_child_main(argv: list[str], body, usage: str) -> int:  # noqa: ANN001
    """A serving child's entry (``python -m MODULE --serve-child IN OUT``): ``body`` of IN's JSON, to OUT."""
    if len(argv) == 3 and argv[0] == "--serve-child":
        Path(argv[2]).write_text(json.dumps(body(json.loads(Path(argv[1]).read_text()))))
        return 0
    print(usage, file=sys.stderr)
    return 2


def _main(argv: list[str]) -> int:
    def body(spec: dict) -> dict:
        return serve_and_measure(spec["verifier"], spec["draft"], spec["prompts"], spec["max_tokens"], spec["temps"],
                                 spec.get("spec_tokens", SPEC_TOKENS), spec.get("per_request", False),
                                 spec.get("max_model_len", 1024), spec.get("spec"), spec.get("dtype", "auto"))  # fmt: skip

    return serve_child_main(argv, body, "usage: python -m hsstream.evaluate --serve-child IN OUT (hsstream eval is the command)")


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
