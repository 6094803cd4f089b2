"""A Llama GGUF (SmolLM2-135M-Instruct's) as an HF checkpoint in bf16, and the check that it is the same model.

transformers reads GGUF files (with the ``gguf`` package) but keeps such a model quantized and
refuses to ``save_pretrained`` it. So: the config and tokenizer (chat template included) come
from transformers' GGUF readers; the weights from its ``load_gguf_checkpoint``, dequantized to
float32 into a ``LlamaForCausalLM`` built on the meta device (the names are HF's; the tied
``lm_head`` is absent and tied after loading); cast to bf16 and saved with the tokenizer.

The check, on a few chat prompts: float32 logits of the saved checkpoint against transformers'
own GGUF load (``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``, another code path)

* **exact**: against that load with its weights rounded to bf16 (what the conversion's cast does
  by design), max |logit difference| <= ``EXACT_TOL`` x max |logit| and the same argmax at every
  position: anything the conversion got wrong (a tensor, a name, a permutation, the tie, the
  config) shows here;
* **bf16 drift**: against that load in float32, max |difference| <= ``DRIFT_TOL`` x max |logit| and
  top-1 agreement >= ``DRIFT_TOP1``: what bf16 storage itself costs;
* **greedy**: the checkpoint answers "What is the capital of France?" with "Paris" in 16 tokens.

The reference logits (rounded load, the prompts' last ``KEEP_POSITIONS`` positions) are kept in
the checkpoint's ``conversion/`` folder with the report, so :func:`recheck` can check the
checkpoint again later without parsing the GGUF (a slow pure-Python reader). vLLM and
transformers read only the folder's top level, so the extra folder is invisible to them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

#: bumped when the files the conversion writes change
CONVERTER_VERSION = "gguf-llama-bf16-v1"
CHECK_DIR = "conversion"
EXACT_TOL = 1e-4
DRIFT_TOL = 0.03
DRIFT_TOP1 = 0.95
KEEP_POSITIONS = 8
CHECK_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child in two sentences.",
)


class ConversionCheckFailed(RuntimeError):
    """The converted checkpoint's logits are not the GGUF model's (one line, for the CLI)."""


def convert(gguf: Path, out: Path, *, say: Callable[[str], None]) -> dict:
    """Write the HF checkpoint of ``gguf`` into the (empty) folder ``out``; what it holds."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    t0 = time.monotonic()
    say(f"reading the config and tokenizer from {gguf.name} (the GGUF reader is slow: about a minute)")
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if cfg.model_type != "llama":
        raise ConversionCheckFailed(f"{gguf.name}: a {cfg.model_type} model; this converter handles Llama GGUFs")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template:
        raise ConversionCheckFailed(f"{gguf.name}: no chat template in the file")
    say(f"dequantizing {gguf.name}'s tensors to float32 ({time.monotonic() - t0:.0f} s so far)")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(cfg)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)["tensors"]
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ConversionCheckFailed(f"{gguf.name}: tensors missing {sorted(set(missing) - allowed)[:5]}, "
                                    f"unexpected {sorted(unexpected)[:5]}")  # fmt: skip
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tok.save_pretrained(out)
    say(f"wrote the bf16 checkpoint in {time.monotonic() - t0:.0f} s")
    return {"tensors": len(tensors), "parameters": sum(p.numel() for p in model.parameters()),
            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}  # fmt: skip


def _prompt_ids(tok, prompt: str) -> list[int]:  # noqa: ANN001
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _logits(model, ids: list[int]):  # noqa: ANN001, ANN202
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def compare(got, ref) -> dict:  # noqa: ANN001
    """Max |got - ref| relative to max |ref|, and the share of positions whose argmax agrees."""
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    return {"max_abs_diff": err, "max_abs_ref": scale, "rel": err / scale if scale else float("inf"),
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}  # fmt: skip


def _load(ckpt: Path):  # noqa: ANN202
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def _verdict(exact: list[dict], drift: list[dict] | None) -> list[str]:
    bad = [f"prompt {i}: {e['rel']:.2e} of max |logit| from the GGUF load (bf16-rounded), top-1 agreement "
           f"{e['top1_agreement']:.3f}" for i, e in enumerate(exact) if e["rel"] > EXACT_TOL or e["top1_agreement"] < 1.0]  # fmt: skip
    bad += [f"prompt {i}: bf16 drift {d['rel']:.3f} of max |logit|, top-1 agreement {d['top1_agreement']:.3f}"
            for i, d in enumerate(drift or []) if d["rel"] > DRIFT_TOL or d["top1_agreement"] < DRIFT_TOP1]  # fmt: skip
    return bad


def check(ckpt: Path, gguf: Path, *, say: Callable[[str], None]) -> dict:
    """Check ``ckpt`` against transformers' own load of ``gguf`` (module docstring); raises
    :class:`ConversionCheckFailed`. Keeps the reference logits and the report in ``ckpt/conversion/``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    say(f"checking: transformers' own GGUF load of {gguf.name} as the reference (another minute or two)")
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    conv = _load(ckpt)
    prompts = [_prompt_ids(tok, p) for p in CHECK_PROMPTS]
    say(f"checking: float32 logits on {len(prompts)} chat prompts ({time.monotonic() - t0:.0f} s so far)")
    ref_f32 = [_logits(ref, ids) for ids in prompts]
    with torch.no_grad():
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    ref_bf16 = [_logits(ref, ids) for ids in prompts]
    del ref
    got = [_logits(conv, ids) for ids in prompts]
    exact = [compare(g, r) for g, r in zip(got, ref_bf16)]
    drift = [compare(g, r) for g, r in zip(got, ref_f32)]
    ids = _prompt_ids(tok, CHECK_PROMPTS[0])
    with torch.no_grad():
        gen = conv.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    answer = tok.decode(gen[0][len(ids) :], skip_special_tokens=True)
    bad = _verdict(exact, drift)
    if "Paris" not in answer:
        bad.append(f"greedy answer to {CHECK_PROMPTS[0]!r} has no 'Paris': {answer!r}")
    report = {
        "converter": CONVERTER_VERSION, "reference": f"transformers AutoModelForCausalLM.from_pretrained(gguf_file={gguf.name!r})",
        "prompts": list(CHECK_PROMPTS), "tolerances": {"exact_rel": EXACT_TOL, "drift_rel": DRIFT_TOL, "drift_top1": DRIFT_TOP1},
        "exact_vs_bf16_rounded_gguf": exact, "drift_vs_float32_gguf": drift, "greedy_answer": answer,
        "passed": not bad, "problems": bad, "wall_s": round(time.monotonic() - t0, 1),
    }  # fmt: skip
    d = ckpt / CHECK_DIR
    d.mkdir(exist_ok=True)
    torch.save({"prompt_ids": prompts, "logits": [r[-KEEP_POSITIONS:].clone() for r in ref_bf16]}, d / "reference_logits.pt")
    (d / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if bad:
        raise ConversionCheckFailed("the converted checkpoint is not the GGUF model: " + "; ".join(bad))
    worst = max(e["rel"] for e in exact)
    say(f"check passed in {report['wall_s']:.0f} s: logits within {worst:.1e} of the GGUF load's (bf16-rounded; "
        f"tolerance {EXACT_TOL:g}), bf16 drift {max(x['rel'] for x in drift):.4f} of max |logit| (tolerance {DRIFT_TOL:g}), "
        f"greedy answer {answer.strip()!r}")  # fmt: skip
    return report


def recheck(ckpt: Path) -> dict:
    """The exact check again, against the reference logits kept at conversion: raises
    :class:`ConversionCheckFailed` if ``ckpt``'s weights no longer give them."""
    import torch

    saved = torch.load(Path(ckpt) / CHECK_DIR / "reference_logits.pt", weights_only=True)
    conv = _load(Path(ckpt))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three short prompts on a 135M model: one thread, never spinning against a busy host
    try:
        exact = [compare(_logits(conv, ids)[-KEEP_POSITIONS:], ref) for ids, ref in zip(saved["prompt_ids"], saved["logits"])]
    finally:
        torch.set_num_threads(threads)
    bad = _verdict(exact, None)
    if bad:
        raise ConversionCheckFailed(f"{ckpt} does not give the logits kept at its conversion: " + "; ".join(bad))
    return {"exact_vs_bf16_rounded_gguf": exact}
