"""Capture: a model as an FX graph with a shape on every tensor node, grouped into layers (trace), and
its repeated blocks as runs of identical blocks (block_runs).

May import: runtime — nothing else of the passes."""
