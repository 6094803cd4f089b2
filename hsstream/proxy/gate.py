"""Whether a new draft may go live: its acceptance on the held-out slice of recent traffic against
the live draft's, measured the way ``hsstream eval`` measures (``hsstream/evaluate.py``: a
scratch vLLM engine, temperature 0, vLLM's own spec-decode counters). Both drafts are measured in
one engine when they share a shape (a checkpoint of a warm-started run and the draft it started
from do): it starts with the new draft, then takes the live one's weights in place, as a serving
engine does; a draft of another shape gets an engine of its own. An engine start is most of a
gate's cost on a CPU core shared with the trainer.

The slice is what the proxy held out of training (``tee.py``: by content hash, never sent to the
sidecar), newest first; each request is prompted as vLLM rendered it (the verifier's chat
template with the generation prompt, its tools and ``chat_template_kwargs``; a completion's
prompt as it was). The figure compared is the mean acceptance length (tokens per verifier step):
the new draft passes when it is at least the live one's plus a margin. A live engine without a
draft counts as 1.0 (one token a step).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

FIGURE = "mean_acceptance_length"


def draft_version(draft: str | Path) -> str:
    """A version name for a draft dir: ``<run>-step<N>`` for a run's checkpoint
    (``RUN/checkpoints/step-N/draft``), else ``<parent>-<name>-<mtime of its weights>``."""
    d = Path(draft).resolve()
    if d.name == "draft" and (m := re.fullmatch(r"step[-_]?(\d+)", d.parent.name)):
        return f"{d.parent.parent.parent.name}-step{int(m.group(1))}"
    if m := re.fullmatch(r"step[-_]?(\d+)", d.name):
        return f"{d.parent.parent.name}-step{int(m.group(1))}"
    w = d / "model.safetensors"
    return f"{d.parent.name}-{d.name}-{int((w if w.exists() else d).stat().st_mtime)}"


def prompts_of(held: list[dict], verifier: str, max_prompt_tokens: int) -> list[list[int]]:
    """Token-id prompts of held-out requests (``/admin/heldout``'s ``samples``), as vLLM renders them."""
    from connector.contract.sample_tokens import SampleRefused, encode_sample, load_tokenizer

    tok = load_tokenizer(verifier)
    out = []
    for h in held:
        p = h["row"]
        kw = json.loads(h["options_key"]) if h.get("options_key") else None
        try:
            if "messages" in p:
                ids, _ = encode_sample(tok, {"messages": p["messages"], **({"tools": p["tools"]} if p.get("tools") else {})},
                                       mode="regenerate", chat_template_kwargs=kw)  # fmt: skip
            else:
                ids, _ = encode_sample(tok, {"prompt": p["prompt"]})
        except (SampleRefused, KeyError, TypeError, ValueError):
            continue
        out.append(ids[-max_prompt_tokens:])
    return out


def measure(new_draft: str, live_draft: str | None, held: list[dict], *, model: str | None = None,
            max_tokens: int = 64, max_model_len: int = 1024, workdir: Path | None = None) -> dict:  # fmt: skip
    """Mean acceptance length (T=0) of the new and the live draft on the held-out prompts."""
    from connector.contract.settings import Settings
    from hsstream import evaluate as E
    from hsstream.measure_in_place import measure_drafts_in_one_engine
    from hsstream.weight_swap import same_shape

    verifier = model or E.draft_verifier(new_draft) or Settings().model
    if not verifier:
        raise ValueError("no verifier: pass --model (the draft's config names none here) or set HSSTREAM_MODEL")
    if not held:
        raise ValueError("the proxy holds no held-out traffic yet (HSSTREAM_PROXY_HOLDOUT_FRACTION > 0, and traffic)")
    prompts = prompts_of(held, verifier, max(1, max_model_len - max_tokens))
    if not prompts:
        raise ValueError(f"none of the {len(held)} held-out requests renders as a prompt for {verifier}")
    if workdir is None:  # the engines' logs and figures: gone with the gate (a failure carries its log's tail)
        with tempfile.TemporaryDirectory(prefix="hsstream-gate-") as tmp:
            return measure(new_draft, live_draft, held, model=model, max_tokens=max_tokens,
                           max_model_len=max_model_len, workdir=Path(tmp))  # fmt: skip
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)

    def one(draft: str | None, name: str) -> float:
        if draft is None:
            return 1.0
        r = E.evaluate(verifier, draft, prompts, max_tokens=max_tokens, temps=[0.0], baseline=False,
                       workdir=wd / name, max_model_len=max_model_len)  # fmt: skip
        return figure(r["temperatures"]["0.0"]["vllm_metrics"])

    (wd / "new").mkdir(exist_ok=True)
    (wd / "live").mkdir(exist_ok=True)
    t0 = time.monotonic()
    if live_draft is not None and same_shape(new_draft, live_draft):
        # one engine: the new draft, then the live one's weights loaded into it in place (no second start)
        both = measure_drafts_in_one_engine(verifier, [new_draft, live_draft], prompts, max_tokens=max_tokens,
                                            workdir=wd / "both", max_model_len=max_model_len)  # fmt: skip
        new, live, engines = figure(both[0]["vllm_metrics"]), figure(both[1]["vllm_metrics"]), 1
    else:
        new, live, engines = one(new_draft, "new"), one(live_draft, "live"), (2 if live_draft is not None else 1)
    return {"figure": FIGURE, "prompts": len(prompts), "max_tokens": max_tokens, "new": round(new, 4),
            "live": round(live, 4), "live_draft": live_draft, "new_draft": new_draft, "engines": engines,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


def figure(vllm_metrics: dict) -> float:
    v = vllm_metrics.get(FIGURE)
    return float(v) if v is not None else 1.0  # nothing drafted: one token a step


def passes(figures: dict, margin: float = 0.0) -> bool:
    return figures["new"] >= figures["live"] + margin
