"""Planning with the compiled makespan replay against its Python form and the general replay. See :mod:`opsched.benchmarks.replay_speed`."""

from opsched.benchmarks.replay_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
