"""Cluster speed: Ray actor env workers against subprocess workers. See :mod:`opsched.benchmarks.cluster_speed`."""

from opsched.benchmarks.cluster_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
