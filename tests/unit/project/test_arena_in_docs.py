"""docs/benchmarks.md's arena rows against their result files: the figures quoted are the JSONs' (CPU
``bench/results/arena_cpu.json``, H200 ``online_gpu_h200x1_shared_arena.json``), and the
acceptance verdict the doc states is the one the JSON's checks compute."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _row(readme: str, start: str) -> str:
    (line,) = [ln for ln in readme.splitlines() if ln.startswith(start)]
    return line


def test_the_cpu_arena_row_quotes_arena_cpu_json():
    d = json.loads((ROOT / "bench/results/arena_cpu.json").read_text())
    row = _row((ROOT / "docs" / "benchmarks.md").read_text(), "| Arena vs files on 2 CPU cores")
    f, a, r = d["arms"]["files"], d["arms"]["arena"], d["arena_vs_files"]
    assert f"{r['bytes_copied_per_sample']['total']:.2f}×" in row
    assert f"{a['bytes_copied_per_sample']['total'] / 1e6:.1f} vs {f['bytes_copied_per_sample']['total'] / 1e6:.1f} MB" in row
    assert f"CPU per sample {r['cpu_ms_per_sample']['total']:.2f}×" in row
    assert f"{r['samples_per_s']:.2f}×" in row
    assert f"p50 {a['p50_ms']:.1f} vs {f['p50_ms']:.1f} ms" in row and f"{r['p50']:.2f}×" in row
    met = d["checks"]["p50_ratio_le_0.6"]
    assert ("not met" not in row) == met, "the doc's verdict on the p50 target must be the JSON's"


def test_the_h200_arena_row_quotes_its_json():
    d = json.loads((ROOT / "bench/results/online_gpu_h200x1_shared_arena.json").read_text())
    s = d["summary"]
    row = _row((ROOT / "docs" / "benchmarks.md").read_text(), "| Arena spool layout vs files")
    a, f = s["by_spool_layout"]["arena"], s["by_spool_layout"]["files"]
    assert f"{a['latency_p50_ms']} ms vs {f['latency_p50_ms']} ms ({s['arena_vs_files_p50']:.3f}×)" in row
    assert f"p99 {a['latency_p99_ms']} vs {f['latency_p99_ms']} ms" in row
    assert f"{a['vllm_ratio_to_plain']:.3f} vs {f['vllm_ratio_to_plain']:.3f} of plain" in row
    later = json.loads((ROOT / "bench/results/online_gpu_h200x1_shared_arena_leases.json").read_text())
    assert not later["errors"]
    s2 = later["summary"]
    a2, f2 = s2["by_spool_layout"]["arena"], s2["by_spool_layout"]["files"]
    assert "check_checksum" not in a2["breakdown"], "the lease run's arena must read its slots unverified"
    assert f"{a2['latency_p50_ms']} ms vs {f2['latency_p50_ms']} ms ({s2['arena_vs_files_p50']:.3f}×)" in row
    assert f"p99 {a2['latency_p99_ms']} vs {f2['latency_p99_ms']} ms" in row


def test_the_h200_fp8_on_device_row_quotes_its_json():
    d = json.loads((ROOT / "bench/results/online_gpu_h200x1_shared_fp8_device.json").read_text())
    assert not d["errors"] and "stream_fp8_device" in d["command"] and "--payload-dtype fp8_e4m3" in d["command"]
    s = d["summary"]
    row = _row((ROOT / "docs" / "benchmarks.md").read_text(), "| FP8 payload quantised on the GPU before the copy")
    dv, hv = s["by_fp8_encoding"]["device"], s["by_fp8_encoding"]["host"]
    assert f"**{dv['vllm_ratio_to_plain']:.3f} vs {hv['vllm_ratio_to_plain']:.3f} of plain**" in row
    assert f"p50 {dv['latency_p50_ms']} vs {hv['latency_p50_ms']} ms ({s['fp8_device_vs_host_p50']:.3f}×)" in row
    assert f"p99 {dv['latency_p99_ms']} vs {hv['latency_p99_ms']} ms" in row
    cs = (dv["breakdown"]["connector_checksum"]["p50_ms"], hv["breakdown"]["connector_checksum"]["p50_ms"])
    assert f"{cs[0]:.1f} vs {cs[1]:.1f} ms p50" in row


def test_the_cpu_arena_row_quotes_the_previous_host_and_the_page_table_runs():
    """The row's verified arm (the arena with ``verify_slots``, same run), the second host (the
    code before the slot's lease, the session before's run) and the prefault's own bench, both
    hosts: each figure from its JSON."""
    row = _row((ROOT / "docs" / "benchmarks.md").read_text(), "| Arena vs files on 2 CPU cores")
    here = json.loads((ROOT / "bench/results/arena_cpu.json").read_text())
    v, r = here["arms"]["arena_verified"], here["arena_verified_vs_files"]
    assert f"gives {v['p50_ms']:.1f} ms, {r['p50']:.2f}×" in row
    assert f"one pass over a 33.5 MB slot takes {v['hop_p50_ms']['checksum']:.1f} ms" in row
    assert "checksum" not in here["arms"]["arena"]["hop_p50_ms"], "the arena arm must read its slots unverified"
    prev = json.loads((ROOT / "bench/results/arena_cpu_prev_host.json").read_text())
    f, a = prev["arms"]["files"], prev["arms"]["arena"]
    assert f"{a['p50_ms']:.1f} vs {f['p50_ms']:.1f} ms, {prev['arena_vs_files']['p50']:.2f}×" in row
    assert f"its pass {a['hop_p50_ms']['checksum']:.1f} ms" in row
    runs = (("arena_pages_cpu.json", "took "), ("arena_pages_cpu_prev_host.json", "on the previous host "))
    for name, prefix in runs:
        pages = json.loads((ROOT / "bench/results" / name).read_text())
        assert all(pages["checks"].values()), name
        fresh, pre = pages["arms"]["fresh"]["p50_ms"], pages["arms"]["prefaulted"]["p50_ms"]
        assert f"{prefix}{fresh:.1f}" in row and f"{pre:.1f} ms" in row, name
