"""Tiny random Qwen3 checkpoint + byte-level BPE tokenizer, built offline.

There is no model hub in the environments this project runs in (CI, the
sandboxed GPU boxes), yet the server, connector and tests need a real
HF-format checkpoint that vLLM and transformers both load unmodified. This
module synthesises one from nothing: a 12-layer Qwen3 with random weights and a
small tokenizer trained on a generated corpus. Everything is seeded so that
every machine produces byte-identical files, which lets tests compare hidden
states across processes and hosts without shipping artefacts around.

Usage::

    from hsstream.tiny_model import build_tiny_verifier, hf_hidden_states
    path = build_tiny_verifier()          # cached after the first call
    ref = hf_hidden_states(path, ids, [0, 6, 12])

or ``python -m hsstream.tiny_model [--out DIR] [--force]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

# Bump whenever anything that changes the produced files changes (corpus,
# tokenizer settings, model config, seeds). A cached build whose marker holds a
# different version is treated as stale and rebuilt.
BUILD_VERSION = "tiny-qwen3-v1"
MARKER_NAME = "BUILD_OK"
DEFAULT_DIR_NAME = "tiny-qwen3"
CACHE_ENV_VAR = "HSSTREAM_CACHE_DIR"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

MODEL_VOCAB_SIZE = 512
# Special tokens are appended after the BPE vocabulary (as in Qwen), so the
# trained part gets whatever room is left under the model's embedding size.
BPE_VOCAB_SIZE = MODEL_VOCAB_SIZE - len(SPECIAL_TOKENS)

MODEL_CONFIG = dict(
    num_hidden_layers=12,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=MODEL_VOCAB_SIZE,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
MODEL_SEED = 0
CORPUS_SEED = 20240601

# Qwen2/Qwen3's pre-tokenisation split, so that word/number/whitespace
# boundaries (and therefore token streams) look like the real model's.
_QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML as used by Qwen. The {% generation %} block wraps exactly the
# assistant-produced text (content plus its closing <|im_end|>, which the model
# must learn to emit), so HF's return_assistant_tokens_mask marks the tokens
# that would carry loss in training.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- else %}"
    "{%- set content = '' %}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------

_NOUNS = (
    "server model token stream layer state cache request batch queue worker "
    "client socket buffer vector matrix tensor kernel thread process file "
    "river mountain city garden window table letter story music language "
    "teacher student doctor engineer farmer artist market bridge train road "
    "computer network signal memory answer question problem result value "
    "system function program library package module object string number"
).split()
_VERBS = (
    "runs sends reads writes builds checks returns computes loads stores "
    "opens closes moves finds makes takes gives keeps starts stops grows "
    "learns teaches watches follows carries shows tells asks helps needs"
).split()
_ADJECTIVES = (
    "small large quick slow bright dark new old simple complex random stable "
    "fast careful quiet loud green blue red yellow warm cold early late "
    "empty full hidden public private final first last next previous"
).split()
_ADVERBS = "quickly slowly carefully often rarely always never again soon later".split()
_FUNCTION = "the a an this that every some each one another".split()
_PREPOSITIONS = "in on under over near with without from into after before".split()
_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar".split()

_UNICODE_PHRASES = (
    "Café au lait, crème brûlée et façade naïve.",
    "Über den Wolken muß die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la biblioteca? ¡Aquí mismo, señor!",
    "Ελληνικά: καλημέρα κόσμε, ευχαριστώ πολύ.",
    "Русский язык: привет, мир! Как дела?",
    "Українська: дякую, будь ласка.",
    "中文：你好，世界！今天天气很好。我们一起学习编程。",
    "日本語：こんにちは世界。カタカナとひらがなと漢字。",
    "한국어: 안녕하세요 세계! 감사합니다.",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "Tiếng Việt: Xin chào thế giới.",
    "Polski: Zażółć gęślą jaźń.",
    "Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Emoji: 🚀 🎉 😀 👍 🔥 ✅ ❌ 🧪 🐍 🦀 🌍 ❤️",
    "Math: ∀x ∈ ℝ, ∃y: x² + y² ≤ 1 ⇒ |x| ≤ 1; ∑ᵢ aᵢ = ∫ f(t) dt ≈ π · e.",
    "Arrows and boxes: ← → ↑ ↓ ┌─┐ │ │ └─┘ • … — – “quoted” ‘single’ «guillemets»",
    "Currency: $5, €10, £3, ¥100, ₹42, ₿0.01",
)

_CODE_TEMPLATES = (
    "def {f}({a}, {b}):\n    \"\"\"Return the {adj} {n} of {a} and {b}.\"\"\"\n"
    "    if {a} is None:\n        return {b}\n    result = {a} + {b} * {k}\n"
    "    return result\n\n",
    "class {C}:\n    def __init__(self, {a}: int = {k}) -> None:\n"
    "        self.{a} = {a}\n        self._{n} = []\n\n"
    "    def {f}(self, {b}):\n        self._{n}.append({b})\n"
    "        return len(self._{n})\n\n",
    "for {a} in range({k}):\n    {b} = {f}({a})\n    if {b} % 2 == 0:\n"
    "        print(f\"{{{a}}}: {{{b}}}\")\n\n",
    "import os\nimport json\n\nwith open(\"{n}.json\", \"r\", encoding=\"utf-8\") as fh:\n"
    "    data = json.load(fh)\n{a} = data.get(\"{b}\", {k})\n\n",
    "function {f}({a}, {b}) {{\n  const {n} = {a}.map((x) => x * {k});\n"
    "  return {n}.filter((y) => y > {b});\n}}\n\n",
    "{{\"{a}\": {k}, \"{b}\": [\"{n}\", \"{adj}\"], \"ok\": true, \"ratio\": 0.{k}}}\n",
    "$ python -m {n}.{f} --{a} {k} --{b}=\"{adj}\"\n",
    "#include <stdio.h>\nint {f}(int {a}, int {b}) {{\n    return {a} * {k} + {b};\n}}\n\n",
    "SELECT {a}, COUNT(*) AS {b} FROM {n} WHERE {a} > {k} GROUP BY {a};\n",
)


def _sentence(rng: random.Random) -> str:
    words = [
        rng.choice(_FUNCTION).capitalize() if rng.random() < 0.8 else rng.choice(_NAMES),
        rng.choice(_ADJECTIVES),
        rng.choice(_NOUNS),
        rng.choice(_VERBS),
        rng.choice(_FUNCTION),
        rng.choice(_NOUNS),
    ]
    if rng.random() < 0.5:
        words += [rng.choice(_PREPOSITIONS), rng.choice(_FUNCTION), rng.choice(_NOUNS)]
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    text = " ".join(words)
    if rng.random() < 0.2:
        text += f", and it's {rng.randint(0, 9999)} times {rng.choice(_ADJECTIVES)}"
    return text + rng.choice(".....?!")


def _code(rng: random.Random) -> str:
    ident = lambda: rng.choice(_ADJECTIVES) + "_" + rng.choice(_NOUNS)  # noqa: E731
    return rng.choice(_CODE_TEMPLATES).format(
        f=ident(),
        a=rng.choice(_NOUNS),
        b=rng.choice(_NOUNS) + "s",
        n=rng.choice(_NOUNS) + "_list",
        C=rng.choice(_ADJECTIVES).capitalize() + rng.choice(_NOUNS).capitalize(),
        adj=rng.choice(_ADJECTIVES),
        k=rng.randint(0, 1000),
    )


def _chat(rng: random.Random) -> str:
    q = _sentence(rng)
    a = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
    return f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n"


def iter_corpus(target_bytes: int = 320_000) -> Iterator[str]:
    """Yield the tokenizer training corpus.

    Generated rather than downloaded so the build works with no network, and
    drawn from a private seeded ``random.Random`` so it is identical on every
    run and does not disturb (or depend on) the global RNG. The mix -- mostly
    English, plus code and a spread of scripts and emoji -- is there so the
    learned merges cover what tests will feed the model, while any byte still
    encodes through the 256-symbol byte-level fallback.
    """
    rng = random.Random(CORPUS_SEED)
    produced = 0
    while produced < target_bytes:
        r = rng.random()
        if r < 0.55:
            doc = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"
        elif r < 0.80:
            doc = _code(rng)
        elif r < 0.92:
            doc = rng.choice(_UNICODE_PHRASES) + " " + _sentence(rng) + "\n"
        else:
            doc = _chat(rng)
        produced += len(doc.encode("utf-8"))
        yield doc


# --------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------


def default_out_dir() -> Path:
    base = os.environ.get(CACHE_ENV_VAR)
    root = Path(base) if base else Path.home() / ".cache" / "hsstream"
    return root / DEFAULT_DIR_NAME


def is_complete(path: str | Path) -> bool:
    """True iff ``path`` holds a finished build of the current version.

    The marker is written last and the folder only appears via an atomic
    rename, so the marker's presence with the right version is sufficient.
    """
    marker = Path(path) / MARKER_NAME
    try:
        return marker.read_text(encoding="utf-8").strip() == BUILD_VERSION
    except OSError:
        return False


def _train_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps character offsets exact (a leading space stays
    # inside its token); HF's assistant-mask computation maps template char
    # spans to tokens through these offsets.
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Chat-control strings in the corpus must not be learned as merges: they
    # become atomic special tokens below, exactly as in Qwen's tokenizer.
    corpus = (doc.replace(IM_START, "").replace(IM_END, "") for doc in iter_corpus())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _build_into(tmp: Path) -> dict:
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    raw = _train_tokenizer()
    if raw.get_vocab_size(with_added_tokens=True) > MODEL_VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab {raw.get_vocab_size()} exceeds model vocab {MODEL_VOCAB_SIZE}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,  # like Qwen: nothing is prepended to prompts
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(tmp)

    ids = {t: raw.token_to_id(t) for t in SPECIAL_TOKENS}
    config = Qwen3Config(
        **MODEL_CONFIG,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        dtype="bfloat16",
    )
    # fork_rng: seed deterministically without clobbering the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
        do_sample=False,
        max_new_tokens=64,
    )
    model.save_pretrained(tmp, safe_serialization=True)

    # transformers 5 writes only "dtype"; readers still on the 4.x schema
    # (older vLLM/transformers, ad-hoc scripts) look for "torch_dtype" and would
    # otherwise assume float32.
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for f in tmp.iterdir():
        os.chmod(f, 0o644)  # safetensors writes 0600; shared caches need group/other read
    return {"tokenizer_vocab_size": len(tokenizer), "special_token_ids": ids}


def build_tiny_verifier(out_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) the tiny Qwen3 checkpoint and return its folder.

    Several processes (pytest-xdist workers, server + client) commonly ask for
    the model at once, so the build is serialised with a file lock and
    published atomically: it happens in a temp sibling folder and is renamed
    into place only after the ``BUILD_OK`` marker -- written last -- exists. A
    crash therefore leaves at worst an orphan temp folder, never a
    half-written directory that ``is_complete`` would accept.
    """
    from filelock import FileLock

    out = Path(out_dir).expanduser() if out_dir is not None else default_out_dir()
    out = out.absolute()
    if not force and is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if not force and is_complete(out):  # another process finished first
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            _build_into(tmp)
            with open(tmp / MARKER_NAME, "w", encoding="utf-8") as fh:
                fh.write(BUILD_VERSION + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            if out.exists() or out.is_symlink():
                # Stale, incomplete or forced: move aside first so the final
                # rename targets a free name (rename can't replace a non-empty dir).
                trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.rename(out, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


# --------------------------------------------------------------------------
# Reference hidden states
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _load_reference_model(model_dir: str, marker_mtime_ns: int, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="eager")
    return model.eval()


def hf_hidden_states(model_dir: str | Path, token_ids: list[int], layer_ids: list[int], dtype: str = "float32"):
    """Reference per-layer hidden states for ``token_ids`` from plain HF, float32, CPU.

    Returns a float32 tensor ``[T, len(layer_ids), hidden_size]``. Layer id
    ``i`` means "the residual stream after ``i`` decoder layers": 0 is the
    embedding output and ``num_hidden_layers`` is the last decoder layer's
    output.

    That last one cannot come from ``output_hidden_states``: HF (Qwen3 in
    transformers 4.x and 5.x alike) overwrites ``hidden_states[-1]`` with
    ``last_hidden_state``, i.e. the value *after* the final RMSNorm, while
    every other entry is a raw residual. Streaming hidden states out of vLLM
    captures decoder-layer outputs, which are pre-norm, so the reference must
    be pre-norm too or the top layer would never match. We therefore take it
    from a pre-forward hook on ``model.model.norm`` (its input is exactly the
    last layer's output). Float32 eager attention keeps the reference free of
    bf16 / kernel-choice noise; ``dtype="bfloat16"`` computes it in the dtype vLLM
    runs a bf16 checkpoint in instead (a deep real model's own bf16 rounding moves
    its largest activations by more than the tests' tolerance: tests/integration/
    connector/test_real_model.py).
    """
    import torch

    model_dir = Path(model_dir)
    marker = model_dir / MARKER_NAME
    mtime = marker.stat().st_mtime_ns if marker.exists() else 0
    model = _load_reference_model(str(model_dir.resolve()), mtime, dtype)
    n_layers = model.config.num_hidden_layers
    layer_ids = [int(i) for i in layer_ids]
    bad = [i for i in layer_ids if not 0 <= i <= n_layers]
    if bad:
        raise ValueError(f"layer ids {bad} out of range [0, {n_layers}]")
    if len(token_ids) == 0:
        raise ValueError("token_ids is empty")

    captured: list = []

    def grab_norm_input(_module, args):
        captured.append(args[0].detach())

    handle = model.model.norm.register_forward_pre_hook(grab_norm_input)
    try:
        with torch.no_grad():
            input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
            out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    assert len(captured) == 1, "final norm should run exactly once"
    hs = out.hidden_states
    picked = [captured[0][0] if i == n_layers else hs[i][0] for i in layer_ids]
    return torch.stack(picked, dim=1).to(torch.float32).contiguous()


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hsstream.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"output folder (default: {default_out_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args(argv)
    print(build_tiny_verifier(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
