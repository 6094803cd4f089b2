"""Several drafts of one shape measured in one vLLM engine, each loaded into it in place: the swap
gate's measure (``hsstream/proxy/gate.py``).

The engine starts with the first draft and our file weight-transfer backend
(``hsstream/weight_swap.py``); each next draft's weights are loaded into the same draft module
through the calls a serving engine takes (``start_draft_weight_update`` → ``update_weights`` →
``finish_weight_update``). One engine start instead of one per draft: on a CPU core shared with
the trainer, the start is most of what a gate costs. The figures are ``hsstream eval``'s
(``hsstream/evaluate.py``): vLLM's own spec-decode counters, temperature 0, differences around
each draft's own batch. The engine runs in a child process (``python -m hsstream.measure_in_place
--serve-child IN OUT``), as ``hsstream eval``'s do.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hsstream.evaluate import SPEC_TOKENS


def serve_and_measure_drafts(verifier: str, drafts: list[str], prompts: list[str] | list[list[int]], max_tokens: int,
                             spec_tokens: int = SPEC_TOKENS, max_model_len: int = 1024, spec: dict | None = None,
                             dtype: str = "auto") -> list[dict]:  # fmt: skip
    """vLLM's counters at temperature 0 for each of ``drafts`` in turn, in one engine (child-process body).

    The engine starts with the first draft and our file weight-transfer backend
    (``hsstream/weight_swap.py``); each next draft's weights are loaded into the same draft module
    in place (``start_draft_weight_update`` → ``update_weights`` → ``finish_weight_update``, the
    calls a serving engine takes), so the drafts must share one shape (:func:`same_shape`). One
    engine start instead of one per draft: what makes a gate affordable beside a trainer on one
    core. Each figure is a difference of counters around its own batch."""
    from vllm import LLM, SamplingParams

    from hsstream import weight_swap
    from hsstream.evaluate import counter_deltas, summarise

    spec = {**(spec or {"method": "eagle3"}), "model": drafts[0], "num_speculative_tokens": spec_tokens}
    llm = LLM(
        model=verifier, speculative_config=spec, disable_log_stats=False, max_model_len=max_model_len, enforce_eager=True,
        gpu_memory_utilization=0.2, seed=0, max_num_seqs=16, dtype=dtype,
        weight_transfer_config=weight_swap.WEIGHT_TRANSFER_CONFIG,
    )  # fmt: skip
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
              for i in range(len(prompts))]  # fmt: skip
    out = []
    for i, d in enumerate(drafts):
        if i:
            llm.start_draft_weight_update()
            llm.update_weights({"update_info": {"path": str(Path(d).resolve()), "version": f"draft-{i}"}})
            llm.finish_weight_update()
        before = llm.get_metrics()
        t0 = time.perf_counter()
        res = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.get_metrics()

        drafts_n, drafted, accepted, per_pos = counter_deltas(before, after)
        gen = sum(len(r.outputs[0].token_ids) for r in res)
        out.append({"draft": d, "vllm_metrics": {"drafts": drafts_n, "drafted": drafted, "accepted": accepted,
                                                 "accepted_per_position": per_pos,
                                                 **summarise(drafts_n, drafted, accepted, per_pos)},
                    "generated_tokens": gen, "wall_s": round(wall, 2),
                    "tokens_per_s": gen / wall if wall else None})  # fmt: skip
    return out


def measure_drafts_in_one_engine(verifier: str, drafts: list[str], prompts: list[str] | list[list[int]], *,
                                 max_tokens: int = 64, workdir: Path, max_model_len: int = 1024,
                                 dtype: str = "auto") -> list[dict]:  # fmt: skip
    """Each draft's figures at temperature 0 (vLLM's counters), one engine for all of them
    (:func:`serve_and_measure_drafts`); the drafts must be of one shape (:func:`same_shape`)."""
    if not drafts:
        raise ValueError("no draft to measure")
    from hsstream.weight_swap import same_shape

    for d in drafts[1:]:
        if not same_shape(drafts[0], d):
            raise ValueError(f"{d} is not of {drafts[0]}'s shape: its weights cannot load in place")
    from hsstream.evaluate import run_child, speculative_config

    spec = speculative_config(drafts[0], None)
    if dtype == "auto":
        from hsstream import launch

        dtype = launch.cpu_serving_dtype(verifier) or "auto"
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    body = {"verifier": verifier, "drafts": [str(d) for d in drafts], "prompts": prompts, "max_tokens": max_tokens,
            "spec_tokens": spec["num_speculative_tokens"], "max_model_len": max_model_len,
            "spec": {k: v for k, v in spec.items() if k not in ("model", "num_speculative_tokens")},
            **({"dtype": dtype} if dtype != "auto" else {})}  # fmt: skip
    return run_child(body, workdir, "drafts", module="hsstream.measure_in_place")


def _main(argv: list[str]) -> int:
    from hsstream.evaluate import serve_child_main

    def body(spec: dict) -> list[dict]:
        return serve_and_measure_drafts(spec["verifier"], spec["drafts"], spec["prompts"], spec["max_tokens"],
                                        spec.get("spec_tokens", SPEC_TOKENS), spec.get("max_model_len", 1024),
                                        spec.get("spec"), spec.get("dtype", "auto"))  # fmt: skip

    return serve_child_main(argv, body, "usage: python -m hsstream.measure_in_place --serve-child IN OUT (the swap gate runs it)")


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
