"""The benchmark harness of opsched, as library code.

``opsched bench`` (:mod:`opsched.benchmarks.run_all`) writes the full report;
each other module is one benchmark with a ``main(argv)`` that writes its own
figures (``python -m opsched.benchmarks.<name>``; the scripts in the
repository's ``bench/`` folder only call these).  Timings, their statistics
and the load they ran under come from :mod:`opsched.timing`, so a benchmark
measures the way ``opsched apply`` and ``opsched compare`` do; a figure the
README quotes is produced here and nowhere else.
"""
