"""``python -m bench.vs_speculators``: see run.py."""

from bench.vs_speculators.run import main

raise SystemExit(main())
