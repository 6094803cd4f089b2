"""Tiny random checkpoints of more verifier families, built offline, for equivalence tests.

Each reuses the tiny Qwen3's tokenizer (so vLLM starts without a download) and gets
random-normal weights (the HF initialiser, std 0.02 on a tiny model: every layer distinct,
unlike ``load_format="dummy"``). Llama's tokenizer prepends a BOS token, as Llama's does.
Families are ones vLLM 0.32 serves with Eagle-3 aux layers (``SupportsEagle3``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from hsstream.tiny_model import ENDOFTEXT, MARKER_NAME, build_tiny_verifier, default_out_dir

BUILD_VERSION = "tiny-families-v1"
COMMON = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-6,
)  # fmt: skip
FAMILIES: dict[str, dict] = {
    "llama": dict(cls="LlamaForCausalLM", cfg="LlamaConfig", num_hidden_layers=6, bos=True),
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig", num_hidden_layers=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True,
    ),  # fmt: skip
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", num_hidden_layers=6),
}


def build_family(name: str, out_dir: str | Path | None = None) -> Path:
    spec = dict(FAMILIES[name])
    out = Path(out_dir) if out_dir else default_out_dir().parent / f"tiny-{name}"
    marker = out / MARKER_NAME
    if marker.exists() and marker.read_text().strip() == BUILD_VERSION:
        return out
    import torch
    import transformers

    base = build_tiny_verifier()
    cls, cfg_cls, bos = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("cfg")), spec.pop("bos", False)
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    tok = json.loads((base / "tokenizer.json").read_text())
    bos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == ENDOFTEXT)
    cfg = cfg_cls(**COMMON, **spec, bos_token_id=bos_id if bos else None)
    torch.manual_seed(0)
    model = cls(cfg).to(torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{name}-", dir=out.parent))
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            shutil.copy(base / f, tmp / f)
    if bos:  # Llama prepends BOS to every encoded prompt
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {ENDOFTEXT: {"id": ENDOFTEXT, "ids": [bos_id], "tokens": [ENDOFTEXT]}},
        }  # fmt: skip
        (tmp / "tokenizer.json").write_text(json.dumps(tok))
        tok_cfg["bos_token"] = ENDOFTEXT
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (tmp / MARKER_NAME).write_text(BUILD_VERSION)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out
