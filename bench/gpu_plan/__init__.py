"""The GPU plan (issue 44): the measurements a rented GPU host still owes, ready to run there.

* ``real_model.py``: the real model's served acceptance on a GPU, for each draft this vLLM serves
  (trained online with ``hsstream up --train``, then served); ``bench/results/real_model_*.json``;
  docs/benchmarks.md "The real model on one H200" and "The real model on a GPU".
* ``d2d_probe.py``: device to device on one GPU (a device-resident slot gathered by one process,
  read by another through CUDA IPC); ``bench/results/d2d_probe_h200.json`` when run there.
* ``carry.py``: a folder carried to the GPU machine in parts, checked and put together there;
  ``env.sh``: sourced by every device call.

Docs: docs/gpu-plan.md.
"""
