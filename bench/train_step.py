"""Training steps: eager, torch.compile, opsched's heuristics and train_step, the lower bound, peak RSS.

See :mod:`opsched.benchmarks.train_step`.
"""

from opsched.benchmarks.train_step import main

if __name__ == "__main__":
    raise SystemExit(main())
