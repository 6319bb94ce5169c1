"""Measurement runs of the pipeline runtime (measure) and where one rank's step went, split into parts
that add up to it (step_timing).

May import: every other subpackage of the runtime."""
