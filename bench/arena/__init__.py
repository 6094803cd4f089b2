"""The arena spool layout (issue 26) beside files, and what its parts cost (``make arena-bench``).

* ``arena.py``: three full stacks (files, arena, arena with every slot checksummed), arms
  interleaved: samples/s and latency from notice to tensor; ``bench/results/arena_cpu.json``.
* ``arena_pages.py``: a process's first touch of a slot, with and without the prefault;
  ``bench/results/arena_pages_cpu.json``.
* ``arena_holds.py``: what a trainer's hold on a slot costs per sample (arena format 3);
  ``bench/results/arena_holds_cpu.json``.

Docs: docs/benchmarks.md "Arena vs files spool layout on 2 CPU cores" and its subsections (the
H200 figures are ``bench/online_gpu/``'s).
"""
