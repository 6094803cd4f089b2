"""The GPU host's studies: online training end to end beside plain vLLM, the CUDA path's
correctness against HF transformers, the extraction's overhead, and a device smoke of the trainer.

* ``online_gpu.py`` (its parts ``online_gpu_config.py``, ``_runner``, ``_consumer``, ``_results``,
  ``_stats``): (a) plain vLLM, (b) vLLM + our connector streamed onto a trainer GPU, (c) the same
  training a draft; results ``bench/results/online_gpu_*.json``; docs/benchmarks.md "Online
  training on GPUs, end to end" (and "The same on one H200" under the arena section).
* ``gpu_check.py``: our files against HF transformers on a random-normal checkpoint written by
  ``checkpoints.py``; results ``bench/results/gpu_check_*.json``; docs/benchmarks.md "CUDA-path
  correctness on the H200".
* ``extract_overhead.py``: plain vLLM vs our connector vs vLLM's Example connector, interleaved;
  results ``bench/results/extract_overhead_*.json``; docs/benchmarks.md "Extraction overhead on an
  H200".
* ``gpu_smoke.py``: a few training steps from an in-memory stream on a device (one or two ranks);
  prints ``GPU_SMOKE_OK``, writes no result (docs/trainer.md).

How these runs are planned on a rented GPU: ``bench/gpu_plan/`` and docs/gpu-plan.md.
"""
