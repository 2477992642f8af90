"""Planning with the fused makespan replay against the general one. See :mod:`opsched.benchmarks.replay_speed`."""

from opsched.benchmarks.replay_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
