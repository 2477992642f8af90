"""Keras training steps (issue 22). See :mod:`opsched.benchmarks.keras_train`."""

from opsched.benchmarks.keras_train import main

if __name__ == "__main__":
    raise SystemExit(main())
