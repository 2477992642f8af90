"""GPU benchmarks (run by ``bench/gpu_check.sh``; needs a CUDA GPU).

See :mod:`opsched.benchmarks.gpu_bench`.
"""

from opsched.benchmarks.gpu_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
