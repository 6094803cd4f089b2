"""Verifier checkpoints the GPU benchmarks write for themselves (no hub, no network there).

Two kinds, both in Hugging Face layout so vLLM, transformers and speculators read them as is:

* :func:`write_random_checkpoint`: a whole Qwen3 (or Nemotron-H hybrid: Mamba-2 + attention +
  MLP blocks) model, every weight drawn from N(0, 0.02)
  (transformers' own initialisation through ``from_config``). Unlike vLLM's
  ``load_format="dummy"`` (uniform in ±1e-3, where every layer's states look alike), the
  residual stream changes from layer to layer, so a swapped or wrong layer cannot pass a
  correctness check.
* :func:`add_verifier_heads`: only the parts an Eagle-3 trainer reads from its verifier
  (input embeddings, final norm, lm_head), for throughput runs whose vLLM uses dummy weights.

Both write a word-level tokenizer covering the model's whole vocabulary (the sidecar loads the
verifier's tokenizer and checks submitted token ids against it) and a marker with the spec, so
``--model-dir`` can reuse a checkpoint and a changed spec rebuilds it.

    python -m bench.online_gpu.checkpoints --out /tmp/qwen3-check --shape check
    python -m bench.online_gpu.checkpoints --out /tmp/qwen3-8b --shape qwen3-8b --heads-only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = "HSSTREAM_CHECKPOINT.json"
STD = 0.02

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": STD, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True,
}  # fmt: skip

#: Qwen3-8B's shape (as in /work/shared/gpu/reference_bench_extract.py).
QWEN3_8B = {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128, "max_window_layers": 36,
            "max_position_embeddings": 40960, "vocab_size": 151936}  # fmt: skip
#: The correctness check's model: ≥ 16 layers, hidden 2048 (Qwen3-1.7B-like, 1.5 B parameters,
#: 3.1 GB in bf16), vocabulary 32,768 so an Eagle-3 draft vocabulary of 32k fits while the
#: embeddings stay small enough to write in seconds.
CHECK = {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
         "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128, "max_window_layers": 28,
         "max_position_embeddings": 40960, "vocab_size": 32768}  # fmt: skip
#: CPU smoke runs: every code path of the GPU scripts, in seconds on two cores.
SMOKE = {**_QWEN3_COMMON, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
         "num_hidden_layers": 8, "num_key_value_heads": 2, "head_dim": 32, "max_window_layers": 8,
         "max_position_embeddings": 4096, "vocab_size": 1024}  # fmt: skip

#: A Nemotron-H-style hybrid (Mamba-2, attention and MLP blocks in one stack), the kind vLLM
#: serves with its hybrid KV-cache manager. 12 blocks, so the check's layer ids [9, 2, 12, 6]
#: land after an MLP, a Mamba, the last (Mamba) and an attention block. Mamba sizes are kept
#: small (16 heads x 64, state 64) so HF's pure-PyTorch scan stays within a few GB at 20k tokens;
#: the SSM dims and block pattern are those of the real family. ``rescale_prenorm_residual`` is
#: off so ``out_proj`` is drawn from N(0, 0.02) like every other matrix; A_log, D and dt_bias
#: keep the family's own initialisation (a normal draw would not be a Mamba layer).
_NEMOTRON_H_COMMON = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": "MM-M-*-M-M*M",
    "num_hidden_layers": 12, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "conv_kernel": 4,
    "chunk_size": 128, "layer_norm_epsilon": 1e-5, "initializer_range": STD, "rescale_prenorm_residual": False,
    "residual_in_fp32": False, "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_conv_bias": True,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "num_nextn_predict_layers": 0,
}  # fmt: skip
HYBRID_CHECK = {**_NEMOTRON_H_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 16, "mamba_head_dim": 64,
                "n_groups": 2, "ssm_state_size": 64, "max_position_embeddings": 32768,
                "vocab_size": 32768}  # fmt: skip
HYBRID_SMOKE = {**_NEMOTRON_H_COMMON, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 8, "mamba_head_dim": 32,
                "n_groups": 2, "ssm_state_size": 64, "max_position_embeddings": 4096,
                "vocab_size": 1024}  # fmt: skip
SHAPES = {"qwen3-8b": QWEN3_8B, "check": CHECK, "smoke": SMOKE, "hybrid-check": HYBRID_CHECK,
          "hybrid-smoke": HYBRID_SMOKE}  # fmt: skip


def _log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _config(shape: dict) -> dict:
    n = shape["vocab_size"]
    return {**shape, "bos_token_id": n - 3, "eos_token_id": n - 1, "pad_token_id": n - 3}


def write_tokenizer(out: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer with exactly ``vocab_size`` ids (the last three are ChatML's
    specials), built in memory: the benchmarks submit token ids, but the sidecar still loads
    the verifier's tokenizer and refuses ids outside its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hsstream.tiny_model import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START

    specials = [ENDOFTEXT, IM_START, IM_END]
    vocab = {f"t{i}": i for i in range(vocab_size - len(specials))}
    vocab.update({t: vocab_size - len(specials) + i for i, t in enumerate(specials)})
    raw = Tokenizer(models.WordLevel(vocab, unk_token=ENDOFTEXT))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=ENDOFTEXT,
                                  bos_token=None, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)  # fmt: skip
    tok.add_special_tokens({"additional_special_tokens": [IM_START]})
    if len(tok) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} ids, wanted {vocab_size}")
    tok.save_pretrained(str(out))


def _spec(kind: str, shape: dict, seed: int) -> dict:
    return {"kind": kind, "config": _config(shape), "std": STD, "seed": seed, "version": 1}


def is_current(out: str | Path, kind: str, shape: dict, seed: int = 0) -> bool:
    try:
        return json.loads((Path(out) / MARKER).read_text()) == _spec(kind, shape, seed)
    except (OSError, ValueError):
        return False


def _publish(tmp: Path, out: Path, spec: dict) -> Path:
    (tmp / MARKER).write_text(json.dumps(spec))
    for f in tmp.iterdir():
        os.chmod(f, 0o644)  # safetensors writes 0600
    os.chmod(tmp, 0o755)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def _device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


_KINDS = {"full": "random checkpoint", "heads": "verifier heads"}


def _build(out: str | Path, kind: str, shape: dict, seed: int, force: bool,
           fill: Callable[[Path, dict], str]) -> Path:  # fmt: skip
    """Reuse ``out`` if its marker matches the spec; else let ``fill`` write the files into a
    temporary sibling (it gets the folder and the config, and returns the device it used) and
    rename that into place, so a reader never sees half a checkpoint and a failed build leaves
    nothing behind."""
    out = Path(out).absolute()
    spec = _spec(kind, shape, seed)
    if not force and is_current(out, kind, shape, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        dev = fill(tmp, spec["config"])
        _log(f"wrote {_KINDS[kind]} {out} ({dev}, {time.perf_counter() - t0:.1f} s)")
        return _publish(tmp, out, spec)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_random_checkpoint(out: str | Path, shape: dict, *, seed: int = 0, device: str | None = None,
                            force: bool = False) -> Path:  # fmt: skip
    """A whole random checkpoint of ``shape``'s architecture (bf16, weights N(0, 0.02), norms 1)
    plus tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def fill(tmp: Path, config: dict) -> str:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        cfg = AutoConfig.from_pretrained(str(tmp))
        dev = _device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if dev.startswith("cuda"):
                torch.cuda.manual_seed_all(seed)
            with torch.device(dev):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        mlp = next(p for n, p in model.named_parameters() if n.endswith("down_proj.weight"))
        std = float(mlp.detach().float().std())
        if not 0.015 < std < 0.025:  # transformers' init changed under us: say so, do not write nonsense
            raise RuntimeError(f"from_config initialised weights with std {std:.4f}, expected ~{STD}")
        model.save_pretrained(str(tmp))
        cfgj = json.loads((tmp / "config.json").read_text())
        cfgj.setdefault("torch_dtype", "bfloat16")  # readers on the transformers 4 schema
        # transformers 5 derives these for Nemotron-H and does not save them; vLLM's own
        # config class, older transformers and hsstream.launch read them from the file.
        for k in ("num_hidden_layers", "hybrid_override_pattern"):
            if k in shape:
                cfgj.setdefault(k, shape[k])
        (tmp / "config.json").write_text(json.dumps(cfgj, indent=1))
        write_tokenizer(tmp, shape["vocab_size"])
        del model
        return dev

    return _build(out, "full", shape, seed, force, fill)


def add_verifier_heads(out: str | Path, shape: dict, *, seed: int = 0, device: str | None = None,
                       force: bool = False) -> Path:  # fmt: skip
    """config.json + tokenizer + random ``model.embed_tokens`` / ``model.norm`` / ``lm_head``.

    What speculators' Eagle-3 draft loads from its verifier (``load_model_layers``:
    embed_tokens, lm_head, model.norm); vLLM serving this folder must use
    ``load_format="dummy"`` since the decoder layers are absent.
    """
    import torch
    from safetensors.torch import save_file

    def fill(tmp: Path, cfg: dict) -> str:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"],
                                                               "eos_token_id": cfg["eos_token_id"]}))  # fmt: skip
        dev = _device(device)
        g = torch.Generator(device=dev).manual_seed(seed)
        v, h = shape["vocab_size"], shape["hidden_size"]

        def rnd(*size: int) -> torch.Tensor:
            return (torch.randn(size, generator=g, device=dev, dtype=torch.float32) * STD).to(torch.bfloat16).cpu()

        tensors = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
                   "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}  # fmt: skip
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer(tmp, v)
        return dev

    return _build(out, "heads", shape, seed, force, fill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="check")
    ap.add_argument("--heads-only", action="store_true", help="only embeddings, final norm, lm_head (+ config)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    fn = add_verifier_heads if a.heads_only else write_random_checkpoint
    print(fn(a.out, SHAPES[a.shape], seed=a.seed, device=a.device, force=a.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
