"""Online vs offline Eagle-3 training on the same samples and the same clock (CPU, tiny verifier;
``make online-vs-offline``).

* ``online_vs_offline.py``: the offline arm (vLLM writes every sample to disk, then the trainer
  reads them), the online arm (trained while vLLM produces) and the regenerated-replies arm, each
  from its first request to its final checkpoint, then served for acceptance;
  ``bench/results/online_vs_offline_cpu.{json,png}``.
* ``ovo_regimes.py``: the ``--regime`` runs (balanced, disk_limited, fresh_replies): their sizes
  and the pure checks that make each the comparison it claims;
  ``bench/results/online_vs_offline_<regime>_cpu.{json,png}``.

Docs: docs/benchmarks.md "Online vs offline on the same clock" and "Online vs offline: regimes".
"""
