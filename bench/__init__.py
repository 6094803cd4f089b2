"""Benchmarks and the long checks, one folder per study; results in ``bench/results/``.

Shared by the studies: ``bench/common/`` (percentiles, the steady-state window, the host's CPU
model, peak bytes on disk). Each study's ``__init__.py`` says what it measures, where its results
are and which section of the docs reports them; the list is in docs/architecture.md ("bench/:
one folder per study").
"""
