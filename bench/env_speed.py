"""Environment speed: ScheduleEnv steps per second on one core. See :mod:`opsched.benchmarks.env_speed`."""

from opsched.benchmarks.env_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
