"""Capture: a model as an FX graph with a shape on every tensor node, grouped into layers (trace), its
repeated blocks as runs of identical blocks (block_runs), and what its forward does that parallel
training would not repeat as one process does, refused (unsupported).

May import: runtime — nothing else of the passes."""
