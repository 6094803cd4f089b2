"""``bench/online_gpu/online_gpu.py``'s arguments, and what follows from them before anything starts.

The flags, their defaults for the CPU smoke, the checks of a GPU split (``ap.error`` before
any process exists), and the vLLM options shared by every arm, so (a) plain vLLM and
(b)/(c) with the connector differ only by the extraction.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.online_gpu import checkpoints as C

ROOT = Path(__file__).resolve().parents[2]

LAYERS = [2, 18, 33, 36]
CONFIGS = ("plain", "stream", "stream_ordered", "stream_arena", "stream_fp8_device", "train")
#: The sidecar's spool layout (``HSSTREAM_SPOOL_LAYOUT``) each stack configuration runs on:
#: ``stream_arena`` is ``stream`` on the arena; the others on files (one stack serves the
#: configurations of a round that share a layout; another layout means another stack).
SPOOL_LAYOUT = {"stream": "files", "stream_ordered": "files", "stream_arena": "arena", "stream_fp8_device": "files",
                "train": "files"}
#: Configurations whose stack's connector quantises to FP8 on the device, before the copy to the
#: host (``HSSTREAM_FP8_ON_DEVICE=1``); the others encode on the host, in the writer threads.
FP8_ON_DEVICE = frozenset({"stream_fp8_device"})


def stack_kind(config: str) -> tuple[str, bool]:
    """What a configuration's stack must be: (spool layout, FP8 on the device). Configurations
    of a round that need the same kind share a stack; another kind stops it and starts one."""
    return SPOOL_LAYOUT[config], config in FP8_ON_DEVICE


def log(*a: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)



def vllm_flags(args: argparse.Namespace) -> list[str]:
    """vLLM flags shared by (a) and (b)/(c), so the two differ only by the extraction."""
    from hsstream import launch

    f = ["--load-format", "dummy", "--skip-tokenizer-init", "--seed", "0", "--max-num-seqs", str(args.max_num_seqs),
         "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    return f + launch.parallel_args(len(args.vllm_gpu_list), args.vllm_tp)


def plain_options(args: argparse.Namespace, model: str, port: int):  # noqa: ANN201
    from hsstream import launch

    return launch.VllmOptions(model=model, layer_ids=LAYERS if not args.smoke else args.layers, spool_dir="",
                              notice_endpoint="", port=port, max_model_len=args.max_model_len,
                              gpu_memory_utilization=args.gpu_mem_util, enforce_eager=True,
                              served_model_name="verifier", extraction=False, extra=vllm_flags(args))  # fmt: skip



def parser(description: str | None) -> argparse.ArgumentParser:
    """The script's flags (``description``: its docstring, shown by ``--help``)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-gpus", default="0", help="CUDA devices of vLLM, e.g. 0 or 0,1")
    ap.add_argument("--trainer-gpus", default="1", help="CUDA devices of the consumers / trainer, e.g. 1 or 2,3")
    ap.add_argument("--vllm-tp", type=int, default=1, help="tensor-parallel size; the vLLM GPUs / TP = DP engines")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--samples", type=int, default=2048, help="samples for (a) and (b)")
    ap.add_argument("--train-samples", type=int, default=2048, help="samples for (c), within --consumer-seconds")
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight: (a)'s client and the sidecar")
    ap.add_argument("--credit", type=int, default=16, help="samples a consumer may hold undelivered")
    ap.add_argument("--stream-workers", type=int, default=8,
                    help="threads the stream reads and checks samples on (0: the iterating thread, as before)")
    ap.add_argument("--trainer-nproc", type=int, default=1,
                    help="(c): DDP trainer ranks on the first N --trainer-gpus (torchrun, as hsstream train --nproc)")
    ap.add_argument("--ordered", action="store_true",
                    help="the stream yields in delivery order (default: each sample as soon as it is checked)")
    ap.add_argument("--finite-on-device", action="store_true",
                    help="(b): the stream copies each sample to the trainer GPU and checks finiteness there")
    ap.add_argument("--checksum", default="blake3", choices=("blake3", "xxh3-128"),
                    help="the connector's checksum kind (named in each notice; the stream checks that kind)")
    ap.add_argument("--payload-dtype", default="model", choices=("model", "fp8_e4m3"),
                    help="HSSTREAM_PAYLOAD_DTYPE of vLLM's connector and the sidecar (fp8_e4m3: quantised on the GPU "
                         "before the copy to the host)")
    ap.add_argument("--spool-budget-gib", type=float, default=8.0)
    ap.add_argument("--writer-threads", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--draft", default="eagle3", help="(c)'s draft: a name in trainer_client.drafts (eagle3, peagle, dflash, dspark)")
    ap.add_argument("--mask-token-id", type=int, default=None,
                    help="peagle/dflash: the mask token (default: the verifier's last vocabulary id; random heads have no zero row)")
    ap.add_argument("--block-size", type=int, default=4, help="dflash: tokens per block")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-mem-util", type=float, default=None, help="default 0.85 (GPU), 0.2 (CPU)")
    ap.add_argument("--model-dir", default=None, help="verifier config + heads (written if absent)")
    ap.add_argument("--start-timeout", type=float, default=None, help="engine/consumer start limit, s")
    ap.add_argument("--config-timeout", type=float, default=None, help="(a)'s requests limit, s")
    ap.add_argument("--consumer-seconds", type=float, default=None, help="(b)/(c) consumers stop after this")
    ap.add_argument("--config-grace", type=float, default=60.0, help="beyond --consumer-seconds before a kill")
    ap.add_argument("--warm-shm-mib", type=int, default=16384)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shape, few samples, trainer on CPU")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines of this split and exit")
    ap.add_argument("--name", default=None, help="result file under bench/results/, e.g. online_gpu_h200x2.json")
    ap.add_argument("--share-gpus", action="store_true",
                    help="allow vLLM and the trainer on the same GPU (one-GPU machines; they compete for it)")
    ap.add_argument("--consumer", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return ap


def resolve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, str]:
    """Fill in what the flags leave to the host (CPU or GPU, smoke or not) and check the split;
    (the model's shape, the verifier folder)."""
    from hsstream import launch

    cpu = launch.is_cpu_build()
    if cpu and not args.smoke and not args.dry_run:
        log("no CUDA device: running the CPU smoke configuration (--smoke)")
        args.smoke = True
    shape = C.SMOKE if args.smoke else C.QWEN3_8B
    n = shape["num_hidden_layers"]
    args.layers = LAYERS if not args.smoke else [2, n // 2, n - 3, n]
    if args.draft in ("peagle", "dflash", "dspark") and args.mask_token_id is None:
        args.mask_token_id = shape["vocab_size"] - 1  # a random heads' row: never zero, and prompts() never draws it
    if args.smoke:
        for k, v in (("samples", 48), ("train_samples", 24), ("warmup", 4), ("prompt_len", 256), ("concurrency", 8),
                     ("credit", 4), ("spool_budget_gib", 0.05), ("writer_threads", 2), ("max_model_len", 512)):
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    args.gpu_mem_util = args.gpu_mem_util or (0.2 if cpu else 0.85)
    args.start_timeout = args.start_timeout or (600 if cpu else 240)
    args.config_timeout = args.config_timeout or (600 if cpu else 180)
    args.consumer_seconds = args.consumer_seconds or (400 if cpu else 120)
    args.vllm_gpu_list = [g for g in args.vllm_gpus.split(",") if g != ""]
    args.trainer_gpu_list = [g for g in args.trainer_gpus.split(",") if g != ""]
    if set(args.vllm_gpu_list) & set(args.trainer_gpu_list) and not cpu and not args.share_gpus:
        ap.error(f"--vllm-gpus {args.vllm_gpus} and --trainer-gpus {args.trainer_gpus} overlap "
                 "(--share-gpus to run both on the same GPUs, with --gpu-mem-util leaving the trainer room)")
    if set(args.configs) & FP8_ON_DEVICE and args.payload_dtype != "fp8_e4m3":
        ap.error("stream_fp8_device compares FP8 encoded on the device with the host's: "
                 "it needs --payload-dtype fp8_e4m3")
    if args.trainer_nproc < 1 or (not cpu and args.trainer_nproc > len(args.trainer_gpu_list)):
        ap.error(f"--trainer-nproc {args.trainer_nproc}: one rank per GPU of --trainer-gpus {args.trainer_gpus}")
    try:
        launch.parallel_args(len(args.vllm_gpu_list), args.vllm_tp)
    except ValueError as e:
        ap.error(str(e))
    model = str(Path(args.model_dir or ("/tmp/hsstream-online-smoke" if args.smoke else "/tmp/hsstream-qwen3-8b-heads"))
                .absolute())  # fmt: skip
    return shape, model
