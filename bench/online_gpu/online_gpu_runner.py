"""``bench/online_gpu/online_gpu.py``'s arms and their order: (a) plain vLLM, (b) the stream, (c) training.

The :class:`Orchestrator` starts each arm's processes (plain vLLM, the stack through
``hsstream.devstack.Stack``, the consumer children), submits the prompts, follows them to the
end, turns the consumers' records into the arm's figures, and stops everything, even on
failure; :func:`run` is the whole call, rounds and configurations in order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.online_gpu.online_gpu_config import ROOT, SPOOL_LAYOUT, log, plain_options, stack_kind, vllm_flags
from bench.online_gpu.online_gpu_results import OUT_DIR, describe, result_name, save, summarize
from bench.online_gpu.online_gpu_stats import (
    SpoolWatch,
    breakdown,
    floor_ms,
    kv_tokens,
    latency,
    timeline,
    window_rate,
)

#: The script the consumer children run (``--consumer``), directly or under torchrun.
SCRIPT = ROOT / "bench" / "online_gpu" / "online_gpu.py"


class ConfigFailed(RuntimeError):
    pass



class Orchestrator:
    def __init__(self, args: argparse.Namespace) -> None:
        from hsstream import launch

        self.args = args
        self.cpu = launch.is_cpu_build()
        self.work = Path(tempfile.mkdtemp(prefix="hsstream-online-"))
        self.children: list = []  # launch.Child of whatever runs now
        self.stack = None
        self.stack_layout: str | None = None  # the running stack's HSSTREAM_SPOOL_LAYOUT
        self.stack_fp8_device = False  # the running stack's HSSTREAM_FP8_ON_DEVICE
        self.doc: dict = {}
        self.prompts: list[list[int]] = []

    # -- children ---------------------------------------------------------------------------------
    def env(self, gpus: str | None) -> dict[str, str]:
        from hsstream import launch

        env = launch.child_env({"PYTHONUNBUFFERED": "1"})
        if gpus is not None and not self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def spawn_consumer(self, mode: str, spec: dict, gpu: str | None, tag: str, ranks: int = 1):  # noqa: ANN201
        """One consumer process; ``ranks`` > 1: torchrun with that many trainer ranks (as
        ``hsstream train --nproc``), one per GPU of ``gpu`` (a list), each with its own files."""
        from hsstream import launch

        sp, out = self.work / f"{tag}.spec.json", self.work / f"{tag}.result.json"
        # A tag's files from an earlier run of the same configuration (the stack warm-up uses the
        # measured run's tags) must not tell the orchestrator this consumer is ready, or hand it an
        # old job: the job was then submitted while the consumer was still starting (its CUDA
        # start and floor measurement, seconds of vLLM's output piling up as a start-up backlog).
        for old in self.work.glob(f"{tag}*"):
            if old.suffix in (".ready", ".json", ".jsonl") and old.name != sp.name:
                old.unlink(missing_ok=True)
        sp.write_text(json.dumps({**spec, "ranks": ranks, "work": str(self.work), "tag": tag}))
        env = self.env(gpu)
        if self.cpu:
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // (2 * ranks))))
        run = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc-per-node={ranks}"]  # fmt: skip
        c = launch.spawn(tag, [*run, str(SCRIPT), "--consumer", str(sp), str(out)], env,
                         log_path=self.work / f"{tag}.log", cwd=str(ROOT))  # fmt: skip
        self.children.append(c)
        return c, out

    def stop_children(self) -> None:
        for c in self.children:
            c.stop(20)
        self.children = []

    # -- configurations -----------------------------------------------------------------------
    def run_plain(self, rnd: int) -> dict:
        from hsstream import launch
        from hsstream.devstack import free_port

        a = self.args
        port = free_port()
        cmd = launch.vllm_args(plain_options(a, self.model, port))
        logf = self.work / f"plain-{rnd}.vllm.log"
        t0 = time.perf_counter()
        v = launch.spawn("vllm-plain", cmd, self.env(a.vllm_gpus), log_path=logf, cwd=str(ROOT))
        self.children.append(v)
        try:
            launch.wait_http(f"http://127.0.0.1:{port}/health", v, a.start_timeout)
            start_s = time.perf_counter() - t0
            log(f"(a) plain vLLM up in {start_s:.0f} s; warm-up, then {len(self.prompts)} prompts, "
                f"concurrency {a.concurrency}")  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            asyncio.run(self._client(url, self.warm_prompts, a.concurrency, a.config_timeout))
            times = asyncio.run(self._client(url, self.prompts, a.concurrency, a.config_timeout))
        finally:
            self.stop_children()
        r = window_rate(times, a.prompt_len)
        out = {"config": "plain", "round": rnd, "engine_start_s": round(start_s, 1), "kv_cache_tokens": kv_tokens(logf),
               "rate": r, "path": "vLLM OpenAI server /v1/completions, one prompt per call (token ids, "
               "max_tokens=1), same concurrency as the sidecar's"}  # fmt: skip
        log(f"(a) plain: {r.get('tok_per_s')} tok/s (steady state), KV cache {out['kv_cache_tokens']} tokens")
        return out

    async def _client(self, url: str, ps: list[list[int]], conc: int, timeout: float) -> list[float]:
        import httpx

        sem = asyncio.Semaphore(conc)
        done: list[float] = []
        limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as c:

            async def one(p: list[int]) -> None:
                async with sem:
                    r = await c.post(f"{url}/v1/completions", json={"model": "verifier", "prompt": p, "max_tokens": 1,
                                                                    "temperature": 0.0})  # fmt: skip
                    if r.status_code != 200:
                        raise ConfigFailed(f"plain vLLM answered {r.status_code}: {r.text[:300]}")
                    done.append(time.time())

            await asyncio.wait_for(asyncio.gather(*(one(p) for p in ps)), timeout)
        return done

    def start_stack(self, rnd: int, layout: str = "files", fp8_device: bool = False) -> float:
        """vLLM + connector + sidecar with the sidecar's spool ``layout`` (``HSSTREAM_SPOOL_LAYOUT``;
        the connector and the trainers follow what each request and delivery names) and the
        payload dtype of ``--payload-dtype`` (vLLM's connector and the sidecar read the same env);
        ``fp8_device``: the connector quantises on the device (``HSSTREAM_FP8_ON_DEVICE``)."""
        from hsstream.devstack import Stack

        a = self.args
        t0 = time.perf_counter()
        wd = self.work / f"stack-{rnd}-{layout}{'-fp8dev' if fp8_device else ''}"
        st = Stack(self.model, a.layers, wd, max_model_len=a.max_model_len,
                   gpu_memory_utilization=a.gpu_mem_util, vllm_extra=vllm_flags(a), vllm_gpus=a.vllm_gpus)  # fmt: skip
        wd.mkdir(exist_ok=True)
        st.env.update({
            "HSSTREAM_MAX_CONCURRENCY": str(a.concurrency),
            "HSSTREAM_SPOOL_BUDGET_BYTES": str(int(a.spool_budget_gib * 2**30)),
            "HSSTREAM_NUM_WRITER_THREADS": str(a.writer_threads),
            "HSSTREAM_CHECKSUM": a.checksum,
            "HSSTREAM_SPOOL_LAYOUT": layout,
            "HSSTREAM_PAYLOAD_DTYPE": a.payload_dtype,
            "HSSTREAM_FP8_ON_DEVICE": "1" if fp8_device else "0",
        })  # fmt: skip
        self.stack, self.stack_layout, self.stack_fp8_device = st, layout, fp8_device
        st.start()
        log(f"stack (vLLM + connector + sidecar, spool layout {layout}, payload {a.payload_dtype}"
            f"{', FP8 on the device' if fp8_device else ''}) up in "
            f"{time.perf_counter() - t0:.0f} s, spool {st.spool}")
        return time.perf_counter() - t0

    def stop_stack(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack.remove_spool()
            self.stack = self.stack_layout = None
            self.stack_fp8_device = False

    def submit(self, ps: list[list[int]]) -> str:
        from connector.contract.rest_client import SidecarError

        try:
            with self.stack.client(timeout=120) as c:
                return c.create_job([{"token_ids": p} for p in ps]).job_id
        except SidecarError as e:
            raise ConfigFailed(f"the sidecar refused the job: {str(e)[:300]}") from e

    def cancel(self, job: str) -> None:
        from connector.contract.rest_client import SidecarError

        try:
            with self.stack.client(timeout=30) as c:
                c.cancel(job)
        except SidecarError:
            pass

    def consumer_spec(self, mode: str, tag: str, n: int, ordered: bool | None = None) -> dict:
        a, st = self.args, self.stack
        return {"mode": mode, "endpoint": st.delivery_endpoint, "spool": str(st.spool), "api": st.api,
                "token": st.token,
                "device": "cpu" if self.cpu else "cuda", "layers": a.layers, "prompt_len": a.prompt_len,
                "hidden_size": self.shape["hidden_size"], "n_samples": n, "time_limit_s": a.consumer_seconds,
                "credit": a.credit, "records": str(self.work / f"{tag}.records.jsonl"),
                "stream_workers": a.stream_workers, "finite_on_device": a.finite_on_device,
                "ordered": a.ordered if ordered is None else ordered,
                "ready_file": str(self.work / f"{tag}.ready"), "job_file": str(self.work / f"{tag}.job.json"),
                "job_wait_s": a.start_timeout, "floor": mode == "deliver", "model": self.model,
                "train_out": str(self.work / f"{tag}.train"), "draft_vocab": a.draft_vocab,
                "draft": a.draft, "mask_token_id": a.mask_token_id, "block_size": a.block_size,
                "token_counts": str(self.work / "token_counts.json")}  # fmt: skip

    def run_consumers(self, mode: str, rnd: int, ps: list[list[int]], ordered: bool | None = None) -> dict:
        """Start the consumers, wait until they are ready, submit the job, follow it to the end."""
        a = self.args
        gpus = a.trainer_gpu_list if mode == "deliver" else a.trainer_gpu_list[:1]
        procs = []
        if mode == "train" and a.trainer_nproc > 1:  # one torchrun, its ranks followed as consumers
            tag = f"{mode}-{rnd}-0"
            spec = self.consumer_spec(mode, tag, len(ps))
            c, _ = self.spawn_consumer(mode, spec, ",".join(a.trainer_gpu_list[: a.trainer_nproc]), tag,
                                       ranks=a.trainer_nproc)  # fmt: skip
            procs = [(f"{tag}-r{k}", c, self.work / f"{tag}-r{k}.result.json") for k in range(a.trainer_nproc)]
            gpus = []
        for i, g in enumerate(gpus):
            tag = f"{mode}-{rnd}-{i}"
            spec = self.consumer_spec(mode, tag, len(ps) if mode == "train" else math.ceil(len(ps) / len(gpus)),
                                      ordered)  # fmt: skip
            procs.append((tag, *self.spawn_consumer(mode, spec, g, tag)))
        deadline = time.monotonic() + a.start_timeout
        for tag, c, _ in procs:
            while not (self.work / f"{tag}.ready").exists():
                if not c.alive():
                    raise ConfigFailed(f"consumer {tag} exited while starting:\n{c.tail()}")
                if time.monotonic() > deadline:
                    raise ConfigFailed(f"consumer {tag} not ready after {a.start_timeout:.0f} s:\n{c.tail()}")
                time.sleep(0.05)
        submitted_at = time.time()
        job = self.submit(ps)
        watch = SpoolWatch(self.stack.spool)
        t0 = time.time()
        for tag, _, _ in procs:
            (self.work / f"{tag}.job.json").write_text(json.dumps({"job": job}))
        limit = a.consumer_seconds + a.config_grace
        results = []
        try:
            for tag, c, out in procs:
                left = max(1.0, limit - (time.time() - t0))
                try:
                    c.proc.wait(left)
                except subprocess.TimeoutExpired:
                    raise ConfigFailed(f"consumer {tag} did not finish within {limit:.0f} s:\n{c.tail()}") from None
                if not out.exists():
                    raise ConfigFailed(f"consumer {tag} exited ({c.proc.returncode}) without a result:\n{c.tail()}")
                r = json.loads(out.read_text())
                if not r.get("ok"):
                    raise ConfigFailed(f"consumer {tag} failed: {r.get('error')}\n{c.tail()}")
                results.append((tag, r))
        finally:
            spool = watch.stop()
            self.cancel(job)
            self.stop_children()
        recs = []
        for tag, _ in results:
            p = self.work / f"{tag}.records.jsonl"
            recs += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        return {"job": job, "results": [r for _, r in results], "records": recs, "submitted_at": submitted_at,
                "accepted_at": t0,
                "spool": {**spool, "budget_bytes": int(a.spool_budget_gib * 2**30)}}  # fmt: skip

    def run_stream(self, rnd: int, plain_rate: float | None, *, ordered: bool | None = None,
                   config: str | None = None) -> dict:
        """(b); ``ordered``: the stream yields in delivery order (the ``stream_ordered`` config,
        run beside ``stream`` on the same stack to show what that order costs); ``config``: the
        configuration's name (``stream_arena``: the same on a stack whose spool is the arena)."""
        a = self.args
        r = self.run_consumers("deliver", rnd, self.prompts, ordered)
        recs = r["records"]
        deliver = window_rate([x["g"] for x in recs], a.prompt_len)
        vllm = window_rate([x["sent"] for x in recs if x.get("sent")], a.prompt_len)
        out = {"config": config or ("stream_ordered" if ordered else "stream"), "round": rnd,
               "spool_layout": self.stack_layout, "payload_dtype": a.payload_dtype,
               "fp8_on_device": self.stack_fp8_device, "consumers": r["results"],
               "spool": r["spool"],
               "delivered_to_trainer_gpu": deliver, "vllm_with_connector": vllm,
               # Over the steady-state window (as the rates), over every delivered sample, and over
               # the job's first samples (its start: the consumer connects before the job exists).
               "latency_notice_to_gpu_ms": latency(recs),
               "floor": r["results"][0].get("floor")}  # fmt: skip
        if plain_rate and deliver.get("tok_per_s"):
            out["ratio_to_plain"] = round(deliver["tok_per_s"] / plain_rate, 4)
        if plain_rate and vllm.get("tok_per_s"):
            out["vllm_ratio_to_plain"] = round(vllm["tok_per_s"] / plain_rate, 4)
        out["timeline"] = timeline(recs, r["submitted_at"], r["accepted_at"],
                                   min((x.get("stream_opened_at") or math.inf) for x in r["results"]))
        out["breakdown"] = breakdown(recs)
        out["breakdown"]["needed"] = bool(out.get("ratio_to_plain") is None or out["ratio_to_plain"] < 0.985)
        out["stream_pool"] = r["results"][0].get("stream_pool")
        log("(b) where latency goes, p50/p99 ms: " + ", ".join(
            f"{k} {v['p50_ms']:.1f}/{v['p99_ms']:.1f}" for k, v in out["breakdown"].items()
            if isinstance(v, dict) and not k.startswith("connector_")))  # fmt: skip
        lat = out["latency_notice_to_gpu_ms"]
        log(f"(b) {out['config']} ({self.stack_layout}): delivered {deliver.get('tok_per_s')} tok/s onto the trainer GPU = {out.get('ratio_to_plain')}"
            f" of plain; vLLM {vllm.get('tok_per_s')} tok/s; notice->GPU p50 {lat['p50']} ms p99 {lat['p99']} ms (window);"
            f" all {lat['all']['n']}: p50 {lat['all']['p50']} p99 {lat['all']['p99']} max {lat['all']['max']} ms;"
            f" first 32 p99 {lat['first_32']['p99']} ms; floor {floor_ms(out)} ms")
        return out

    def run_train(self, rnd: int, plain_rate: float | None) -> dict:
        a = self.args
        ps = self.prompts[: a.train_samples]
        r = self.run_consumers("train", rnd, ps)
        recs, res = r["records"], dict(r["results"][0])
        if len(r["results"]) > 1:  # DDP: samples/tokens are already all ranks' (all-reduced); waits per rank
            ranks = r["results"]
            res.update(wall_s=max(x["wall_s"] for x in ranks), wait_s=max(x["wait_s"] for x in ranks),
                       wait_frac=round(statistics.mean(x["wait_frac"] for x in ranks), 4), ranks=ranks)  # fmt: skip
            res["yielded_per_rank"] = [sum(1 for x in recs if x.get("rank") == k) for k in range(len(ranks))]
        handed = window_rate([x["y"] for x in recs], a.prompt_len)
        vllm = window_rate([x["sent"] for x in recs if x.get("sent")], a.prompt_len)
        wait = res.get("wait_frac")
        out = {"config": "train", "round": rnd, "trainer": res, "spool": r["spool"],
               "trainer_rate": handed, "vllm_with_connector": vllm,
               "trainer_samples_per_s_overall": round(res["samples"] / res["wall_s"], 2) if res.get("wall_s") else None,
               "trainer_tokens_per_s_overall": round(res["tokens"] / res["wall_s"], 1) if res.get("wall_s") else None}  # fmt: skip
        if plain_rate and vllm.get("tok_per_s"):
            out["vllm_ratio_to_plain"] = round(vllm["tok_per_s"] / plain_rate, 4)
        # The trainer waits little: it is the slower side and vLLM is held back by the spool
        # budget; it waits much: the producer (vLLM + connector + stream) is.
        out["bound_by"] = None if wait is None else ("trainer" if wait < 0.05 else "producer (vLLM + stream)")
        out["spool_within_budget"] = r["spool"]["peak_bytes"] <= r["spool"]["budget_bytes"]
        log(f"(c) train on {res.get('device_used')}: {out['trainer_samples_per_s_overall']} samples/s, "
            f"{out['trainer_tokens_per_s_overall']} tok/s, waiting {wait}, vLLM {vllm.get('tok_per_s')} tok/s, "
            f"peak spool {r['spool']['peak_bytes'] / 2**20:.0f} MiB of {r['spool']['budget_bytes'] / 2**20:.0f}; "
            f"bound by {out['bound_by']}")  # fmt: skip
        return out



def prompts(n: int, plen: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab - 3, size=(n, plen)).tolist()


def dry_run(args: argparse.Namespace, model: str) -> int:
    """The command lines this split would start, without starting anything."""
    from hsstream import launch
    from hsstream.up import hsstream_vllm_cli

    print("(a) plain vLLM, CUDA_VISIBLE_DEVICES=" + args.vllm_gpus + ":")
    print("  " + " ".join(launch.vllm_args(plain_options(args, model, 8000))))
    cli = hsstream_vllm_cli(model, args.layers, "127.0.0.1", 8000, max_model_len=args.max_model_len,
                            gpu_memory_utilization=args.gpu_mem_util, enforce_eager=True,
                            extra=["--served-model-name", "verifier", *vllm_flags(args)])  # fmt: skip
    i = cli.index("--") if "--" in cli else len(cli)
    r = subprocess.run([sys.executable, "-m", "hsstream", "vllm", *cli[:i], "--dry-run", *cli[i:]],
                       env=launch.child_env({"HSSTREAM_SPOOL_DIR": "/dev/shm/hsstream-online"}), capture_output=True,
                       text=True, cwd=str(ROOT))  # fmt: skip
    print(f"(b)/(c) vLLM + connector (hsstream vllm), CUDA_VISIBLE_DEVICES={args.vllm_gpus}:")
    print("  " + (r.stdout.strip() or r.stderr.strip()))
    def kind(c: str) -> str:
        layout, fp8_dev = stack_kind(c)
        return f"{c} ({layout}{', FP8 on the device' if fp8_dev else ''})"

    order = [kind(c) if c in SPOOL_LAYOUT else c for c in args.configs]
    print(f"order, {args.rounds} round(s): {', '.join(order)}; a stack per kind in a round, each with its warm-up; "
          f"stack env HSSTREAM_SPOOL_LAYOUT=<layout> HSSTREAM_FP8_ON_DEVICE=<0|1> HSSTREAM_PAYLOAD_DTYPE={args.payload_dtype} "
          f"HSSTREAM_CHECKSUM={args.checksum}")  # fmt: skip
    ranks = args.trainer_gpu_list[: args.trainer_nproc]
    print(f"consumers: (b) one per trainer GPU {args.trainer_gpu_list}; (c) trainer on {ranks[0]}"
          if args.trainer_nproc == 1 else f"consumers: (b) one per trainer GPU {args.trainer_gpu_list}; "
          f"(c) {args.trainer_nproc} DDP ranks (torchrun) on {ranks}")  # fmt: skip
    return r.returncode


def run(args: argparse.Namespace, shape: dict, model: str) -> int:
    """Every round of every configuration, the result rewritten after each; the exit status."""
    name = result_name(args)
    o = Orchestrator(args)
    o.shape, o.model = shape, model
    doc = o.doc
    doc.update(describe(args, shape))

    def on_signal(signum, _frame) -> None:  # noqa: ANN001
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    rc = 1
    try:
        t0 = time.perf_counter()
        hc = [sys.executable, "-m", "bench.online_gpu.checkpoints", "--out", model, "--shape", "smoke" if args.smoke else "qwen3-8b",
              "--heads-only"]  # fmt: skip
        subprocess.run(hc, env=o.env(args.trainer_gpu_list[0]), cwd=str(ROOT), check=True, timeout=300)
        log(f"verifier heads ready in {time.perf_counter() - t0:.0f} s: {model}")
        if not args.smoke and Path("/dev/shm").exists():
            log(f"pre-touching {args.warm_shm_mib} MiB of /dev/shm (guest RAM grows on first touch)")
            subprocess.run(["dd", "if=/dev/zero", "of=/dev/shm/hsstream-warm", "bs=1M", f"count={args.warm_shm_mib}"],
                           capture_output=True, timeout=120)  # fmt: skip
            Path("/dev/shm/hsstream-warm").unlink(missing_ok=True)
        o.prompts = prompts(args.samples, args.prompt_len, shape["vocab_size"], 0)
        o.warm_prompts = prompts(args.warmup, args.prompt_len, shape["vocab_size"], 1)
        from trainer_client.train import vocab as V

        V.save_token_counts(V.count_tokens(o.prompts), o.work / "token_counts.json")
        plain_rate = None
        for rnd in range(args.rounds):
            for cfg in args.configs:
                t1 = time.perf_counter()
                try:
                    if cfg == "plain":
                        run = o.run_plain(rnd)
                        plain_rate = run["rate"].get("tok_per_s") or plain_rate
                    else:
                        layout, fp8_dev = stack_kind(cfg)
                        if o.stack is not None and (o.stack_layout, o.stack_fp8_device) != (layout, fp8_dev):
                            log(f"{cfg} needs spool layout {layout}, FP8 on the device {fp8_dev}; the stack runs "
                                f"{o.stack_layout}, {o.stack_fp8_device}: stopping it, starting one")
                            o.stop_stack()
                        if o.stack is None:
                            doc.setdefault("stack_start_s", []).append(round(o.start_stack(rnd, layout, fp8_dev), 1))
                            doc.setdefault("stacks", []).append({"round": rnd, "before": cfg, "spool_layout": layout,
                                                                 "fp8_on_device": fp8_dev})
                            log(f"stack warm-up: {len(o.warm_prompts)} samples")
                            w = o.run_consumers("deliver", rnd, o.warm_prompts)
                            wl = latency(w["records"])
                            doc["stacks"][-1]["warmup_latency_ms"] = {k: wl[k] for k in ("all", "first_32")}
                            log(f"stack warm-up: notice->GPU over all {wl['all']['n']}: p50 {wl['all']['p50']} "
                                f"p99 {wl['all']['p99']} max {wl['all']['max']} ms")
                        run = (o.run_train(rnd, plain_rate) if cfg == "train"
                               else o.run_stream(rnd, plain_rate, ordered=True if cfg == "stream_ordered" else None,
                                                 config=cfg))
                        run["spool_layout"], run["fp8_on_device"] = o.stack_layout, o.stack_fp8_device
                        run["kv_cache_tokens"] = kv_tokens(o.stack.workdir / "vllm.log")
                    run["seconds"] = round(time.perf_counter() - t1, 1)
                    doc["runs"].append(run)
                except Exception as e:  # noqa: BLE001 - record it, clean up, go on with the next configuration
                    log(f"configuration {cfg} (round {rnd}) FAILED: {e}")
                    doc["errors"].append({"config": cfg, "round": rnd, "error": str(e)[:3000]})
                    if cfg != "plain":
                        o.stop_stack()
                save(doc, name)
            o.stop_stack()
        summarize(doc)
        rc = 0 if not doc["errors"] and doc["runs"] else 1
    except KeyboardInterrupt as e:
        doc["errors"].append({"error": f"interrupted: {e}"})
    finally:
        o.stop_children()
        o.stop_stack()
        shutil.rmtree(o.work, ignore_errors=True)
        save(doc, name)
    log(f"wrote {OUT_DIR / name}")
    return rc
