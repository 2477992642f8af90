"""Training-step capture: capture time, ops per phase, eager step vs replay.

See :mod:`opsched.benchmarks.train_capture`.
"""

from opsched.benchmarks.train_capture import main

if __name__ == "__main__":
    raise SystemExit(main())
