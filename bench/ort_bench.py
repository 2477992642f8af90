"""opsched's plans on ONNX Runtime's kernels (the ``ort`` backend) against ONNX Runtime sequential.

See :mod:`opsched.benchmarks.ort_bench`.  Writes ``runs/bench/ort_bench.{json,md}``.

    python bench/ort_bench.py                                   # every section, the six zoo models at batch 1 and 8
    python bench/ort_bench.py --sections ratios --models lstm --batches 1 --rounds 5
"""

from opsched.benchmarks.ort_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
