"""A briefly pre-trained tiny verifier, so that measuring a draft on it means something.

The random tiny verifier (:mod:`hsstream.tiny_model`) falls into single-token loops under
greedy decoding; any draft predicts a loop, so acceptance measured on it says nothing about
the draft. A few minutes of next-token training on a synthetic *structured* corpus (templated
sentences, key-value facts that are queried again later, ``a+b=c;`` sums, counting, lists
repeated) gives it context-dependent behaviour instead: what comes next depends on what came
earlier, which is exactly what a draft needs the verifier's hidden states for.

Everything is seeded and single-process, and the result is cached under a name derived from
a content hash of the base checkpoint, the corpus version and the training settings, so every
caller (tests, ``bench/served_acceptance/acceptance.py``, ``make demo``) shares one build and a changed
ingredient can never reuse a stale one.

Usage::

    from hsstream.pretrain_verifier import pretrained_verifier, greedy_repeat_fraction
    path = pretrained_verifier()          # minutes the first time, then cached

or ``python -m hsstream.pretrain_verifier [--force]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hsstream import tiny_model as tm

#: Bump whenever the corpus generator or the training loop changes what gets produced.
PRETRAIN_VERSION = "structured-v1"
MARKER_NAME = "PRETRAIN_OK"
REPORT_NAME = "pretrain_report.json"


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

_COLORS = "red blue green yellow dark bright quiet warm cold".split()
_PLACES = "city garden river market bridge mountain library".split()
_ITEMS = "apples letters tokens books files stones songs".split()
_NUMBER_WORDS = "zero one two three four five six seven eight nine".split()


def _facts(rng: random.Random) -> str:
    """Key-value facts, then questions about some of them: the answer is only in the context."""
    names = rng.sample(tm._NAMES, k=rng.randint(2, 4))
    facts = {n: (rng.choice(_COLORS), rng.choice(_PLACES)) for n in names}
    parts = [f"{n} lives in the {c} {p}." for n, (c, p) in facts.items()]
    for n in rng.sample(names, k=len(names)):
        c, p = facts[n]
        parts.append(f"Where does {n} live? {n} lives in the {c} {p}.")
    return " ".join(parts)


def _sums(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(3, 8)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append(f"{a}+{b}={a + b};")
    return " ".join(out)


def _counting(rng: random.Random) -> str:
    start, step = rng.randint(0, 80), rng.choice((1, 1, 2, 5, 10))
    n = rng.randint(5, 12)
    if rng.random() < 0.3:
        k = rng.randint(0, 5)
        return "count: " + ", ".join(_NUMBER_WORDS[k : k + rng.randint(3, 10 - k)]) + "."
    return "count: " + " ".join(str(start + i * step) for i in range(n)) + "."


def _lists(rng: random.Random) -> str:
    items = rng.sample(tm._NOUNS, k=rng.randint(3, 6))
    head = f"{rng.choice(tm._NAMES)} has {rng.randint(2, 9)} {rng.choice(_ITEMS)}: "
    return head + ", ".join(items) + ". Again: " + ", ".join(items) + "."


def _sentences(rng: random.Random) -> str:
    return " ".join(tm._sentence(rng) for _ in range(rng.randint(1, 3)))


_KINDS = ((_facts, 0.3), (_sums, 0.15), (_counting, 0.15), (_lists, 0.15), (_sentences, 0.25))


def document(rng: random.Random) -> str:
    """One corpus document: a few structured pieces, so that a 128-token window mixes kinds."""
    parts = []
    for _ in range(rng.randint(2, 4)):
        r, acc = rng.random(), 0.0
        for fn, w in _KINDS:
            acc += w
            if r < acc:
                parts.append(fn(rng))
                break
        else:
            parts.append(_sentences(rng))
    return " ".join(parts)


def corpus_documents(n: int, seed: int) -> list[str]:
    """``n`` documents from a private RNG: the same on every machine, independent of global state."""
    rng = random.Random(seed)
    return [document(rng) for _ in range(n)]


#: Seeds of the disjoint document sets: pre-training the verifier, training drafts, evaluating.
SEED_PRETRAIN = 1001
SEED_DRAFT_TRAIN = 2002
SEED_HELD_OUT = 3003


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    num_docs: int = 20000
    threads: int = 1


def _pack(tok, docs: list[str], seq_len: int):  # noqa: ANN001
    """Concatenate documents with end-of-text separators and cut into fixed windows."""
    import torch

    eot = tok.convert_tokens_to_ids(tm.ENDOFTEXT)
    ids: list[int] = []
    for d in docs:
        ids.extend(tok(d, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    n = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


def greedy_repeat_fraction(model_dir: str | Path, prompts: list[str] | None = None, new_tokens: int = 48) -> float:
    """Fraction of greedily generated tokens equal to the token just before them.

    A verifier stuck in single-token loops scores near 1; the acceptance measurement needs
    one well below 0.3. Measured with plain transformers (float32) on held-out prompts.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if prompts is None:
        prompts = held_out_prompts(16)
    rep = tot = 0
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = model.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            seq = out[0].tolist()
            gen_from = ids.shape[1]
            for i in range(gen_from, len(seq)):
                rep += int(seq[i] == seq[i - 1])
                tot += 1
    return rep / max(1, tot)


def held_out_prompts(n: int, seed: int = SEED_HELD_OUT, max_chars: int = 120) -> list[str]:
    """Prompts cut from documents the verifier and the draft never trained on (other seeds: other prompts)."""
    rng = random.Random(seed + 1)
    out = []
    for d in corpus_documents(n, seed):
        cut = rng.randint(min(40, len(d) - 1), min(max_chars, len(d) - 1))
        out.append(d[:cut])
    return out


def _say(msg: str) -> None:
    print(msg, flush=True)


def _train(base: Path, out: Path, cfg: PretrainConfig, log=_say) -> dict:  # noqa: ANN001
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    tok = AutoTokenizer.from_pretrained(str(base))
    data = _pack(tok, corpus_documents(cfg.num_docs, SEED_PRETRAIN), cfg.seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

        def lr_at(step: int) -> float:
            if step < cfg.warmup:
                return (step + 1) / cfg.warmup
            p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        g = torch.Generator().manual_seed(cfg.seed)
        t0 = time.perf_counter()
        losses = []
        for step in range(cfg.steps):
            idx = torch.randint(0, data.shape[0], (cfg.batch_size,), generator=g)
            batch = data[idx]
            # HF shifts the labels itself: the window is both input and label.
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if step % 50 == 0 or step == cfg.steps - 1:
                log(f"pretrain step {step:4d}/{cfg.steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (base / f).exists():
            shutil.copy2(base / f, out / f)
    cfg_path = out / "config.json"
    c = json.loads(cfg_path.read_text())
    c.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return {"final_loss": sum(losses[-20:]) / len(losses[-20:]), "train_s": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def content_hash(base: Path, cfg: PretrainConfig) -> str:
    """Hash of everything the result depends on: base weights + tokenizer, corpus version, settings."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        h.update(name.encode())
        h.update(hashlib.sha256((base / name).read_bytes()).digest())
    h.update(PRETRAIN_VERSION.encode())
    h.update(json.dumps(asdict(cfg), sort_keys=True).encode())
    return h.hexdigest()[:16]


def pretrained_verifier(
    cache_dir: str | Path | None = None, cfg: PretrainConfig | None = None, *, force: bool = False, log=_say  # noqa: ANN001
) -> Path:
    """Build (or reuse) the pre-trained tiny verifier and return its folder.

    Serialised with a file lock and published by an atomic rename after the marker is
    written, as the base build is, so concurrent callers never see half a checkpoint.
    """
    from filelock import FileLock

    cfg = cfg or PretrainConfig()
    base = tm.build_tiny_verifier()
    root = Path(cache_dir) if cache_dir else tm.default_out_dir().parent
    out = (root / f"tiny-qwen3-pretrained-{content_hash(base, cfg)}").absolute()
    if not force and (out / MARKER_NAME).exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{out.name}.lock")):
        if not force and (out / MARKER_NAME).exists():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=root))
        try:
            report = _train(base, tmp, cfg, log)
            report["greedy_repeat_fraction"] = greedy_repeat_fraction(tmp)
            report["config"] = asdict(cfg)
            report["version"] = PRETRAIN_VERSION
            (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
            (tmp / MARKER_NAME).write_text(PRETRAIN_VERSION + "\n")
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if out.exists():
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsstream.pretrain_verifier", description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--force", action="store_true")
    p.add_argument("--steps", type=int, default=PretrainConfig.steps)
    a = p.parse_args(argv)
    out = pretrained_verifier(a.cache_dir, PretrainConfig(steps=a.steps), force=a.force)
    print(out)
    print((out / REPORT_NAME).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
