"""Why a sequence-parallel graph does not run on its shapes, where a size read is the cause: a
length read from a value split along the sequence is the rank's share of it, not the model's."""
from __future__ import annotations

import torch
import torch.fx as fx

from runtime.comm import collectives as c

# nodes that pass a value on unchanged but for where it lives: the value read is their input
_PASSED_ON = {c.sp_scatter, c.sp_all_gather, c.sp_gather, torch.clone}


def sp_size_read(failed: fx.Node, env: dict, full: dict, layer_key: str) -> str | None:
    """The size read that made `failed` go wrong: the last integer of its layer (the nodes whose
    meta[layer_key] is failed's), computed before it (`env`: the rank's values so far), that
    runs to another value than the model's (`full`); None where there is none."""
    layer = failed.meta.get(layer_key)
    reads = [n for n, v in env.items() if type(v) is int and n.meta.get(layer_key) == layer
             and type(full.get(n)) is int and full[n] != v]
    if not reads:
        return None
    read = reads[-1]
    return (f"{_describe(read)} is {env[read]} on each rank where the model has "
            f"{full[read]}: under sequence parallelism that value is split along the sequence; "
            f"hold the size in the model (a constant, or read from a value every rank holds "
            f"whole), or plan the layer with strategy=tp")


def shapes_clash(failed: fx.Node, env: dict, full: dict) -> str:
    """What `failed` was given on the rank beside what the model gives it: the shapes of its
    tensor inputs (torch's own message names argument indices and internal checks)."""
    def shapes(values: dict) -> str:
        return ", ".join(f"{a.name} {tuple(values[a].shape)}" for a in failed.all_input_nodes
                         if isinstance(values.get(a), torch.Tensor))
    return (f"its inputs do not fit together on the rank ({shapes(env)}; in the model "
            f"{shapes(full)})")


def _describe(read: fx.Node) -> str:
    """'node getitem_9 (add_1.shape[1])', or the node's name where it is not such a read."""
    shape, index = (read.args + (None, None))[:2]
    if isinstance(shape, fx.Node) and shape.target is getattr and shape.args[1:] == ("shape",):
        return f"node {read.name} ({_source(shape.args[0]).name}.shape[{index}])"
    if read.target == "size" and isinstance(shape, fx.Node):
        return f"node {read.name} ({_source(shape).name}.size({index}))"
    return f"node {read.name}"


def _source(value: fx.Node) -> fx.Node:
    while value.op == "call_function" and value.target in _PASSED_ON and value.args:
        value = value.args[0]
    return value
