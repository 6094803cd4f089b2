"""What the study runs: its sizes, the training recipe both arms share, and the time estimate
the full run's sizes were chosen from. Pure (no torch, no vLLM): unit-tested.

Sizing rule (issue 39): at least 2,000 conversations and the whole run under 60 minutes on
two cores; what gives way, in order, is the draft vocabulary, then the tokens per sample, then
the number of conversations, never the fairness between the arms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

#: Eagle-3's aux layers for a verifier of ``n`` layers (speculators' and ours): 2, n//2, n-3.
def aux_layers(n: int) -> list[int]:
    return [2, n // 2, n - 3]


@dataclass(frozen=True)
class Sizes:
    conversations: int  # trained on, in both arms (one epoch)
    val_rows: int  # speculators' validation split (its trainer needs one; never trained on)
    tokens: int  # tokens per sample: every sample is cut to exactly this many
    min_trained: int  # loss-carrying tokens a sample needs in its window
    draft_vocab: int
    prompts: int  # held-out prompts served
    max_tokens: int  # tokens generated per prompt (EOS ignored, as hsstream eval does)
    max_prompt_tokens: int
    points: int  # served checkpoints per arm (one every steps / points, the last at the end)

    def as_dict(self) -> dict:
        return asdict(self)


#: The headline run (docs/benchmarks.md). Chosen from :func:`estimate_s` with the rates the
#: issue measured; ``--plan`` prints the estimate, ``--plan --rates-from JSON`` redoes it from a
#: run's own figures.
FULL = Sizes(conversations=2000, val_rows=20, tokens=128, min_trained=32, draft_vocab=4096, prompts=32,
             max_tokens=64, max_prompt_tokens=256, points=4)  # fmt: skip
#: ``--reduced``: every stage on the real model, small (~12 min on two quiet cores).
REDUCED = Sizes(conversations=200, val_rows=4, tokens=96, min_trained=24, draft_vocab=4096, prompts=8,
                max_tokens=32, max_prompt_tokens=192, points=2)  # fmt: skip
#: ``--quick``: the plumbing on the tiny pre-trained verifier (vocabulary 512), a few minutes.
QUICK = Sizes(conversations=40, val_rows=4, tokens=64, min_trained=8, draft_vocab=256, prompts=6, max_tokens=16,
              max_prompt_tokens=200, points=2)  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    """The training settings both arms run with. Where the two trainers' defaults differ, the
    value is one both can take: speculators' AdamW (its ``--optimizer adamw``: torch's betas
    0.9/0.999, its default weight decay 0.01), a cosine decay to zero after a warm-up of 1 % of
    the steps (speculators' default warm-up), one sample per step, fp32 on the CPU."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    warmup_share: float = 0.01
    grad_clip: float = 1.0
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss: str = "kl_div (eager)"
    attn: str = "sdpa"
    samples_per_step: int = 1
    precision: str = "float32 (no autocast)"
    seed: int = 0
    torch_threads: int = 1
    # the draft: one llama decoder layer with full attention (window 4096, as ours builds it),
    # norm before the residual, no norm before fc, no output norm (speculators' from_training_args
    # defaults, which ours uses; speculators' CLI defaults differ and are set to these)
    draft_layers: int = 1
    sliding_window: int = 4096
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    norm_output: bool = False

    def warmup_steps(self, steps: int) -> int:
        return steps // 100 if self.warmup_share == 0.01 else int(steps * self.warmup_share)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


RECIPE = Recipe()

#: The rates the estimate starts from (issue 39's measurements on the 2-core machine, and this
#: study's reduced runs): tokens a second trained by one core, prefilled by vLLM on one core,
#: generated while serving on two; seconds to start vLLM, a trainer, the data-generation client.
DEFAULT_RATES = {"train_tok_s": 200.0, "extract_tok_s": 650.0, "serve_tok_s": 120.0, "vllm_start_s": 45.0,
                 "trainer_start_s": 30.0, "client_start_s": 15.0, "prepare_s": 150.0,
                 "select_s_per_row": 0.1}  # fmt: skip
#: A smaller draft vocabulary makes the step cheaper: its head is 2 × hidden × vocab FLOPs a
#: token per TTT step and pass; the rest of the step does not change. Hidden 576 (SmolLM2): the
#: decoder layer and fc cost about as much as a 4k-token head.
HEAD_SHARE_AT_8K = 0.55


def train_tok_s(rates: dict, vocab: int, rate_vocab: int = 8192) -> float:
    """The training rate at ``vocab`` from one measured at ``rate_vocab`` (head cost linear in it)."""
    head = HEAD_SHARE_AT_8K * rate_vocab / 8192
    cost = (1 - head) + head * vocab / rate_vocab
    return rates["train_tok_s"] / cost


def estimate_s(z: Sizes, rates: dict | None = None, rate_vocab: int = 8192) -> dict:
    """Seconds each part of a run of sizes ``z`` should take, and their sum."""
    r = {**DEFAULT_RATES, **(rates or {})}
    rows = z.conversations + z.val_rows
    tok = z.conversations * z.tokens
    train = tok / train_tok_s(r, z.draft_vocab, rate_vocab)
    extract = rows * z.tokens / r["extract_tok_s"]
    ours = r["vllm_start_s"] + r["trainer_start_s"] + max(train, extract) + 10
    theirs = (r["vllm_start_s"] + r["client_start_s"] + extract + r["trainer_start_s"] + train
              + z.val_rows * z.tokens / (3 * train_tok_s(r, z.draft_vocab, rate_vocab)))  # fmt: skip
    engines = 2 * z.points + 2  # each arm's points, the untrained draft, the verifier alone
    serve = engines * (r["vllm_start_s"] + 2 * z.prompts * z.max_tokens / r["serve_tok_s"])
    # the data selection reads and tokenises the file until it has enough rows (cached afterwards)
    select = (rows + z.prompts) * r["select_s_per_row"]
    total = select + r["prepare_s"] + ours + theirs + serve
    return {"select": select, "prepare": r["prepare_s"], "ours": ours, "theirs": theirs, "serve": serve, "total": total,
            "train_per_arm": train, "extract": extract, "rates": r}  # fmt: skip


def fit(budget_s: float = 3600.0, rates: dict | None = None, base: Sizes = FULL, rate_vocab: int = 8192,
        vocabs: tuple[int, ...] = (8192, 4096), tokens: tuple[int, ...] = (192, 160, 128, 112, 96, 80, 64),
        min_conversations: int = 2000) -> Sizes:  # fmt: skip
    """The largest run under ``budget_s``, giving way in the issue's order: the draft vocabulary
    first, then the tokens per sample, then the conversations (down to ``min_conversations``,
    then below it in steps of 10 %)."""
    for t in tokens:
        for v in vocabs:
            z = replace(base, draft_vocab=v, tokens=t, min_trained=t // 4)
            if estimate_s(z, rates, rate_vocab)["total"] <= budget_s:
                return z
    z = replace(base, draft_vocab=vocabs[-1], tokens=tokens[-1], min_trained=tokens[-1] // 4)
    n = z.conversations
    while n > 100 and estimate_s(replace(z, conversations=n), rates, rate_vocab)["total"] > budget_s:
        n = int(n * 0.9)
    return replace(z, conversations=n)
