"""Served acceptance, measured as ``hsstream eval`` measures it (hsstream/evaluate.py): vLLM (CPU)
serves the verifier with a checkpoint as its Eagle-3 draft, 3 speculative tokens, on the held-out
prompts at T=0 and T=1; vLLM's spec-decode counters give the acceptance rate and the mean
acceptance length (1 + accepted / drafts), each request's own records the same figures again.

Every engine of the study is started alike (both cores, after both arms have finished), so the
served figures differ only by the draft.
"""

from __future__ import annotations

from pathlib import Path

from bench.vs_speculators.common import log

TEMPS = [0.0, 1.0]
SPEC_TOKENS = 3


def point(r: dict) -> dict:
    """One served engine's figures per temperature: vLLM's counters' (the reported ones) and the
    requests' own (a second source), tokens/s."""
    out = {}
    for t, v in r.items():
        if not isinstance(v, dict) or "generated_tokens" not in v:
            continue
        key = "T0" if float(t) == 0.0 else "T1" if float(t) == 1.0 else f"T{t}"
        vm, ours = v.get("vllm_metrics") or {}, v.get("ours") or {}
        out[key] = {"mean_acceptance_length": vm.get("mean_acceptance_length"), "acceptance_rate": vm.get("acceptance_rate"),
                    "acceptance_per_position": vm.get("acceptance_per_position"), "drafts": vm.get("drafts"),
                    "per_request": {"mean_acceptance_length": ours.get("mean_acceptance_length"),
                                    "acceptance_rate": ours.get("acceptance_rate")},
                    "tokens_per_s": v.get("tokens_per_s"), "generated_tokens": v.get("generated_tokens")}  # fmt: skip
    out["engine_wall_s"] = r.get("engine_wall_s")
    return out


def serve(verifier: str, draft: str | None, prompts: list[list[int]], max_tokens: int, wd: Path, name: str,
          max_model_len: int) -> dict:  # fmt: skip
    from hsstream import evaluate as E

    spec = E.speculative_config(draft, SPEC_TOKENS) if draft else None
    r = E.run_serving(verifier, draft, prompts, max_tokens, TEMPS, wd, name, spec_tokens=SPEC_TOKENS, per_request=True,
                      max_model_len=max_model_len, spec=spec)  # fmt: skip
    p = point(r)
    if draft:
        log(f"served {name}: mean acceptance length T=0 {p['T0']['mean_acceptance_length']:.3f}, "
            f"T=1 {p['T1']['mean_acceptance_length']:.3f}; {p['T0']['tokens_per_s']:.1f} tok/s at T=0")
    else:
        log(f"served {name} (no draft): {p['T0']['tokens_per_s']:.1f} tok/s at T=0")
    return p
