"""TensorFlow thread settings for Keras application models. See :mod:`opsched.benchmarks.keras_settings`."""

from opsched.benchmarks.keras_settings import main

if __name__ == "__main__":
    raise SystemExit(main())
