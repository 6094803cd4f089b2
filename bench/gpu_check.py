#!/usr/bin/env python3
"""CUDA-path correctness: our connector's files equal vLLM's Example connector's, row for row.

Same dummy-weight Qwen3-8B-shaped model, same prompts (lengths chosen to hit a partial
block, several chunks of our bounded gather, and a single token), one engine per process.
Ours runs with the layer order [33, 2, 36, 18]; the Example stores ascending [2, 18, 33, 36];
after permuting, the two must agree (bf16, same kernels: exactly or within rounding).
Writes bench/results/gpu_check_h200.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.extract_overhead import QWEN3_8B, NoticeConsumer  # noqa: E402

LENGTHS = [1, 17, 1024, 3001, 20000]
OURS = [33, 2, 36, 18]
ASC = sorted(OURS)


def child(mode: str, out: Path) -> None:
    import numpy as np
    from vllm import LLM, SamplingParams

    from hsstream import launch

    mdir = Path("/tmp/qwen3_8b_dummy")
    mdir.mkdir(exist_ok=True)
    (mdir / "config.json").write_text(json.dumps(QWEN3_8B))
    spool = Path(f"/dev/shm/hsstream-check-{mode}")
    shutil.rmtree(spool, ignore_errors=True)
    spool.mkdir(parents=True)
    kw = dict(model=str(mdir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=32768, enable_prefix_caching=False, enforce_eager=True, gpu_memory_utilization=0.85)
    if mode == "ours":
        ep = f"ipc:///tmp/hsstream-check-{os.getpid()}.sock"
        consumer = NoticeConsumer(ep, spool)
        consumer.keep = True
        o = launch.VllmOptions(model=str(mdir), layer_ids=OURS, spool_dir=str(spool), notice_endpoint=ep)
        kw["speculative_config"], kw["kv_transfer_config"] = launch.extraction_configs(o)
    else:
        kw["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ASC}}}
        kw["kv_transfer_config"] = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"shared_storage_path": str(spool)}}
    llm = LLM(**kw)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1000, 150000, size=n).tolist()} for n in LENGTHS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    if mode == "ours":
        consumer.wait(len(prompts), 120)  # every file complete (notice after rename)
    else:
        time.sleep(5)  # the Example connector gives no completion signal but its lock files
    from safetensors.torch import load_file

    res = []
    for p, o in zip(prompts, outs):
        path = o.kv_transfer_params["hidden_states_path"]
        d = load_file(path)
        res.append({"n": len(p["prompt_token_ids"]), "path": path,
                    "ids_ok": d["token_ids"].tolist() == p["prompt_token_ids"]})
        dst = out.parent / f"{mode}-{len(res)}.pt"
        import torch

        torch.save(d["hidden_states"], dst)
        res[-1]["tensor"] = str(dst)
    llm.llm_engine.engine_core.shutdown()
    shutil.rmtree(spool, ignore_errors=True)
    out.write_text(json.dumps(res))


def main() -> int:
    if len(sys.argv) == 3:
        child(sys.argv[1], Path(sys.argv[2]))
        os._exit(0)
    import torch

    work = Path("/tmp/hsstream-check")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    for mode in ("ours", "example"):
        subprocess.run([sys.executable, __file__, mode, str(work / f"{mode}.json")], check=True, timeout=400)
    ours, ex = (json.loads((work / f"{m}.json").read_text()) for m in ("ours", "example"))
    perm = [ASC.index(i) for i in OURS]
    rows = []
    for a, b in zip(ours, ex):
        ta, tb = torch.load(a["tensor"]), torch.load(b["tensor"])[:, perm]
        diff = (ta.float() - tb.float()).abs()
        rows.append({"tokens": a["n"], "shape": list(ta.shape), "ids_ok": a["ids_ok"] and b["ids_ok"],
                     "equal": bool(torch.equal(ta, tb)), "max_abs_diff": float(diff.max()),
                     "max_abs_value": float(tb.float().abs().max())})  # fmt: skip
        print(rows[-1], flush=True)
    ok = all(r["ids_ok"] and r["shape"][0] == r["tokens"] and r["max_abs_diff"] <= 0.01 * r["max_abs_value"]
             for r in rows)  # fmt: skip
    doc = {"benchmark": "gpu_check", "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "layers_ours": OURS,
           "layers_example": ASC, "rows": rows, "ok": ok, "command": "python bench/gpu_check.py"}
    for d in [ROOT / "bench" / "results", Path(os.environ.get("OUT", ROOT / "bench" / "results"))]:
        (d / "gpu_check_h200.json").write_text(json.dumps(doc, indent=1))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
