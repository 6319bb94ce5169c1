"""What a saved-tensor hook may keep of the tensor autograd hands it.

A pack hook (torch.autograd.graph.saved_tensors_hooks) that keeps the tensor itself keeps its
grad_fn, and when an op saves its own output (log_softmax, for one) that grad_fn is the node
holding the packed object: a cycle through autograd's C++ graph that Python's collector cannot
see. A backward without retain_graph breaks it by releasing the saved tensors; a graph retained
and then dropped (ZB-H1's split backward: I keeps the graph for W, and W's backwards need not
reach every node) leaks every such tensor, one micro-batch's activations per step. Keeping a
detached alias (the same storage, no grad_fn) has no cycle; autograd only reads the values.
"""
from __future__ import annotations

import torch


def without_graph(t: torch.Tensor) -> torch.Tensor:
    """The tensor a pack hook keeps: `t`'s storage, without its autograd history."""
    return t.detach()
