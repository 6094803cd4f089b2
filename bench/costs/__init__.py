"""What one part costs, each measured alone: small probes of the connector, the stream, the
sidecar, the client and the host, each writing one ``bench/results/`` file.

* ``checksum_cost.py``: the connector's per-sample checksum by kind and threads;
  ``checksum_*.json``; docs/benchmarks.md "The connector's checksum: kind and threads".
* ``fp8_gather_cost.py``: FP8 quantised on the device vs on the host (GPU);
  ``fp8_gather_h200*.json``; docs/benchmarks.md "FP8 quantised on the device vs on the host".
* ``validate_throughput.py``: the trainer's checks of one sample, old vs new;
  ``validate_throughput_cpu.json``; docs/benchmarks.md "Bursts through the stream on 2 CPU cores".
* ``host_checks.py``: a CPU trainer's finiteness checks and the writer's verdict;
  ``host_checks_cpu.json``; docs/benchmarks.md (the arena section's host checks).
* ``sidecar_overhead.py``: tokens/s through the sidecar vs straight to vLLM;
  ``sidecar_overhead_cpu*.json``; docs/benchmarks.md "Sidecar overhead on 2 CPU cores".
* ``sidecar_throughput.py``: samples/s through the sidecar alone, vLLM stood in for;
  ``sidecar_throughput*.json``, ``sidecar_successive_jobs.json``; docs/benchmarks.md "Sidecar
  throughput on 2 CPU cores".
* ``ingest.py``: a 1M-line JSONL through ``hsstream submit``; ``ingest_cpu.json``;
  docs/benchmarks.md "Measured", docs/architecture.md.
* ``sharegpt_submit.py``: ShareGPT V3 as shipped through ``hsstream submit``;
  ``sharegpt_submit_cpu.json``; docs/benchmarks.md "ShareGPT V3 as shipped through hsstream submit".
* ``proxy_latency.py``: what the serving proxy adds per request and per chunk;
  ``proxy_latency_*_cpu.json``; docs/live-traffic.md "The proxy".
* ``weight_transfer_cpu.py``: vLLM's weight-transfer backends and ours on the CPU build;
  ``weight_transfer_cpu.json``; docs/live-traffic.md "The swap".
* ``cpu_dtype.py``: bf16 vs float32 on this CPU; ``cpu_dtype.json``; docs/deploy.md.
"""
