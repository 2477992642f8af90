"""Runtime overhead of TorchCPUBackend over the plain node-by-node runner.

See :mod:`opsched.benchmarks.runtime_overhead`.
"""

from opsched.benchmarks.runtime_overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
