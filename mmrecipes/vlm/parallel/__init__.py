"""Parallelism over a sequence: Ulysses sequence parallelism (the split after the vision merge)."""
