"""The headline study (issue 39, part 4): this project's online Eagle-3 training beside
speculators' own offline pipeline, on SmolLM2-135M-Instruct and ShareGPT as shipped.

run.py orchestrates; data.py selects and hashes the conversations; ours.py and theirs.py are
the two arms; spec_train.py runs speculators' trainer on the CPU; serve.py measures served
acceptance as ``hsstream eval`` does; results.py (pure) holds the checks, the comparison, the
doc table and the plot; plan.py the sizes, the shared recipe and the time estimate.
"""
