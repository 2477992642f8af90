"""Per-framework adapters of the one apply pipeline (:mod:`opsched.scheduled`)."""
