"""Whether a new draft may go live: its acceptance on the held-out slice of recent traffic against
the live draft's, measured the way ``hsstream eval`` measures (``hsstream/evaluate.py``: a
scratch vLLM engine per draft, temperature 0, vLLM's own spec-decode counters).

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

    verifier = model or E.draft_verifier(new_draft) or Settings().model
    if not verifier:
        raise ValueError("no verifier: pass --model (the draft's config names none here) or set HSSTREAM_MODEL")
    if not held:
        raise ValueError("the proxy holds no held-out traffic yet (HSSTREAM_PROXY_HOLDOUT_FRACTION > 0, and traffic)")
    prompts = prompts_of(held, verifier, max(1, max_model_len - max_tokens))
    if not prompts:
        raise ValueError(f"none of the {len(held)} held-out requests renders as a prompt for {verifier}")
    wd = Path(workdir or tempfile.mkdtemp(prefix="hsstream-gate-"))
    wd.mkdir(parents=True, exist_ok=True)

    def one(draft: str | None, name: str) -> float:
        if draft is None:
            return 1.0
        r = E.evaluate(verifier, draft, prompts, max_tokens=max_tokens, temps=[0.0], baseline=False,
                       workdir=wd / name, max_model_len=max_model_len)  # fmt: skip
        v = r["temperatures"]["0.0"]["vllm_metrics"][FIGURE]
        return float(v) if v is not None else 1.0

    (wd / "new").mkdir(exist_ok=True)
    (wd / "live").mkdir(exist_ok=True)
    return {"figure": FIGURE, "prompts": len(prompts), "max_tokens": max_tokens, "new": round(one(new_draft, "new"), 4),
            "live": round(one(live_draft, "live"), 4), "live_draft": live_draft, "new_draft": new_draft}  # fmt: skip


def passes(figures: dict, margin: float = 0.0) -> bool:
    return figures["new"] >= figures["live"] + margin
