"""The whole loop, measured by served acceptance: hidden states streamed from vLLM train a draft
that vLLM then serves, beside an untrained draft (``make demo``, ``make real-acceptance``).

* ``acceptance.py``: the tiny pre-trained verifier, any draft (``--draft``);
  ``bench/results/acceptance_*cpu*.json``; docs/trainer.md "The proof on a CPU machine" and
  docs/benchmarks.md "Measured".
* ``real_acceptance.py``: SmolLM2-135M-Instruct on ShareGPT (what ``make demo`` runs);
  ``bench/results/real_demo_cpu_run*.json``; docs/benchmarks.md "The demo, the test suite and the
  long checks", docs/real-model.md.
* ``fp8_acceptance.py``: FP8 vs bf16 payloads, acceptance.py once per arm and seed;
  ``bench/results/fp8_vs_bf16_acceptance.json``; docs/benchmarks.md "FP8 vs bf16 payloads on the
  CPU demo".
* ``trainer_speed.py``: the trainer's speed for a draft this vLLM cannot serve, on the same loop;
  ``bench/results/trainer_speed_<draft>_cpu.json``; docs/trainer.md.
"""
