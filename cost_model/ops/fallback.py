"""The cost of an op no rule knows: conservative and memory-bound, with one warning naming it.

A planner that refuses a model for one unfamiliar op (a custom fused kernel, a user function kept
as a call by torch.fx.wrap, a new aten op) fails the user for a detail; one that prices it as
free plans on a lie. The middle road: price it as a memory-bound kernel that reads every tensor
input, writes every output and does one FLOP per element of the largest; its backward, when a
floating input needs a gradient, reads the output gradients and writes one per input (twice the
forward's FLOPs, as for pointwise ops), and autograd is assumed to keep every floating input —
the most a pointwise-like op could keep, so the activation memory is not underestimated. Matmul-
like ops are not memory-bound, so an op of that kind without a rule is under-priced in time;
the warning says so, once per op and process (`UnpricedOpWarning`, a UserWarning subclass).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Mapping

from torch import nn
from torch.fx import Node

from cost_model.ops import graph_facts as g
from cost_model.ops.graph_facts import OpCost

_WARNED: set[str] = set()
_RECORDING: list[set[str]] = []  # open `recording()` contexts, innermost last


class UnpricedOpWarning(UserWarning):
    """An op had no cost rule and was priced by the conservative memory-bound rule."""


def priced(node: Node, modules: Mapping[str, nn.Module], what: str) -> OpCost:
    """The fallback cost of `node`; `what` is the line naming it (node, target, module)."""
    key = what.split(": ", 1)[-1].split(" in module ")[0]  # the op, not the node
    for seen in _RECORDING:
        seen.add(key)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{what}: priced as memory-bound (reads its inputs, writes its outputs, "
                      f"keeps its inputs for backward); add a rule in cost_model.ops.rules if it "
                      f"is compute-bound", UnpricedOpWarning, stacklevel=3)
    return cost(node, modules)


@contextlib.contextmanager
def recording():
    """The ops priced by this fallback inside the block (every time, not once per process as
    the warning): a plan names them."""
    seen: set[str] = set()
    _RECORDING.append(seen)
    try:
        yield seen
    finally:
        _RECORDING.remove(seen)


def cost(node: Node, modules: Mapping[str, nn.Module]) -> OpCost:
    ins = g.unique(g.tensor_args(node))
    in_ts = [t for i in ins for t in g.tensors_in(g.value(i))]
    outs = g.tensors_in(g.value(node))
    flops = float(max((g.numel(t) for t in in_ts + outs), default=0))
    fwd_bytes = sum(g.nbytes(t) for t in in_ts + outs)
    needs_grad = [i for i in ins if g.requires_grad(i)
                  and any(g.is_float(t) for t in g.tensors_in(g.value(i)))]
    if not needs_grad or not any(g.is_float(t) for t in outs):
        return g.finish("elementwise", flops, 0, fwd_bytes, 0)
    saved = tuple(entry for i in ins if any(g.is_float(t) for t in g.tensors_in(g.value(i)))
                  for entry in g.keep(i, modules))
    bwd_bytes = g.grad_io_bytes(node, ins) + g.saved_bytes(saved)
    return g.finish("elementwise", flops, g.BWD_FACTOR * flops, fwd_bytes, bwd_bytes, saved)
