"""Drafts that follow live traffic, measured side by side on CPU (issue 43; not in CI).

``study.py`` replays prompts through the proxy whose mix shifts part-way (ShareGPT, then
HumanEval): a static arm serves draft D0, a live arm also tees the traffic into the stack,
trains on it and swaps each gated checkpoint in; both arms' served acceptance over time, each
swap and the checks are recorded. ``report.py`` writes docs/benchmarks.md's section from the
result. Results: ``bench/results/live_traffic_cpu.{json,png}``. Docs: docs/benchmarks.md "Drafts
that follow live traffic, on a real model", docs/live-traffic.md "The study".
"""
