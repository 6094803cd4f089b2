#!/usr/bin/env python3
"""Online training on GPUs, end to end, beside plain vLLM: the benchmark users look at.

vLLM on ``--vllm-gpus`` feeds hidden states (Qwen3-8B shape, layers [2, 18, 33, 36],
1,024-token samples submitted over REST as token ids) to consumers on ``--trainer-gpus``.
One call runs, in this order (``--rounds`` repeats the sequence: a b c a b c ...):

(a) ``plain``: plain vLLM (no extraction), its OpenAI server, the same prompts sent by a
    client with the same concurrency as the sidecar's (one ``/v1/completions`` call per
    prompt, ``max_tokens=1``): prefill tok/s. Same server path as (b), so the two compare.
(b) ``stream``: vLLM + our connector -> /dev/shm spool -> sidecar -> ``HiddenStateStream`` ->
    tensors resident in the trainer GPU's memory (pinned host buffer, async copy, event), no
    training: tokens/s delivered onto the trainer GPU ÷ (a); latency from the connector's
    notice (``Notice.sent_at``) to the sample on the trainer GPU, p50/p99, one host clock;
    the floor (read one sample's file from tmpfs and copy it to the GPU); where time goes.
(b') ``stream_arena``: (b) on a sidecar whose spool is the arena (``HSSTREAM_SPOOL_LAYOUT=arena``:
    one shared-memory file, a slot per sample, read in place). A round's stack configurations
    share one stack while they share a layout; a configuration on the other layout stops it and
    starts one on its own (with the warm-up), so ``--configs plain stream stream_arena --rounds 2``
    runs a b b' a b b'. The summary gives each layout's latency, stages and rates ÷ plain, and
    ``arena_vs_files_p50`` (each run records its ``spool_layout``). ``--payload-dtype fp8_e4m3``:
    every stack's connector encodes FP8: on the host, in its writer threads after the copy, except
    (b'') ``stream_fp8_device``: (b) with the connector quantising on the GPU before the copy
    (``HSSTREAM_FP8_ON_DEVICE=1``, its own stack); the summary's ``by_fp8_encoding`` gives both
    places' latency, stages and vLLM ÷ plain, and ``fp8_device_vs_host_p50``.
(c) ``train``: the same stack with Eagle-3 training on the trainer GPU (draft vocabulary
    32k): trainer samples/s and tokens/s, its share of time waiting for data, vLLM's tok/s
    meanwhile, peak spool bytes vs budget, and which side bounds throughput.

Rates are taken in steady state: from the 10th to the 90th percentile of completion times
(responses for (a), samples on the trainer GPU for (b), samples handed to the trainer for (c)).
KV-cache capacity with and without extraction comes from vLLM's "KV cache size" log line.

One process orchestrates; vLLM, the sidecar and the consumers are child processes in their
own process groups, each configuration is bounded in time, everything (engines, spool) is
stopped and removed even on failure, and the JSON is rewritten after every configuration.

GPU (H200 x2):  python bench/online_gpu/online_gpu.py --vllm-gpus 0 --trainer-gpus 1
CPU smoke:      python bench/online_gpu/online_gpu.py --smoke   (writes bench/results/online_gpu_smoke_cpu.json)
Command lines for other splits:  python bench/online_gpu/online_gpu.py --vllm-gpus 0,1 --vllm-tp 2 --dry-run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script (python bench/online_gpu/online_gpu.py): the repository's packages

# The parts, one module each; their names are re-exported here for the tests and other callers.
from bench.online_gpu.online_gpu_config import CONFIGS, LAYERS, log, parser, plain_options, resolve, vllm_flags  # noqa: E402
from bench.online_gpu.online_gpu_consumer import consume_deliver, consume_train, consumer_main, measure_floor, train_config  # noqa: E402
from bench.online_gpu.online_gpu_results import describe, result_name, save, summarize  # noqa: E402
from bench.online_gpu.online_gpu_runner import ConfigFailed, Orchestrator, dry_run, prompts, run  # noqa: E402
from bench.online_gpu.online_gpu_stats import WINDOW, SpoolWatch, breakdown, kv_tokens, latency, pct, timeline, window_rate  # noqa: E402

__all__ = [
    "CONFIGS",
    "LAYERS",
    "WINDOW",
    "ConfigFailed",
    "Orchestrator",
    "SpoolWatch",
    "breakdown",
    "consume_deliver",
    "consume_train",
    "consumer_main",
    "describe",
    "dry_run",
    "kv_tokens",
    "latency",
    "log",
    "main",
    "measure_floor",
    "pct",
    "plain_options",
    "prompts",
    "result_name",
    "run",
    "save",
    "summarize",
    "timeline",
    "train_config",
    "vllm_flags",
    "window_rate",
]


def main() -> int:
    ap = parser(__doc__)
    args = ap.parse_args()
    if args.consumer:
        consumer_main(*args.consumer)
    shape, model = resolve(ap, args)
    if args.dry_run:
        if not (Path(model) / "config.json").exists():
            Path(model).mkdir(parents=True, exist_ok=True)
            (Path(model) / "config.json").write_text(json.dumps(shape))
        return dry_run(args, model)
    return run(args, shape, model)


if __name__ == "__main__":
    sys.exit(main())
