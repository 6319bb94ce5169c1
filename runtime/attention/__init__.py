"""Attention kernels a captured model keeps as one graph node: causal attention with per-head
sink logits and an optional sliding window (sinks; GPT-OSS's attention).

May import: nothing of the runtime."""
