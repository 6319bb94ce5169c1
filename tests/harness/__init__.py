"""Test harnesses: faults injected into real runs (faults), a save killed mid-write (checkpoint_faults),
and random models × random plans compared with one process (fuzzing). Tests and examples import
them; the product never does (tests/unit/test_floors.py)."""
