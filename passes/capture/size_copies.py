"""Sizes read in one layer and used in another are read again where they are used.

A model commonly reads its batch size once, at the top of forward (`B = x.shape[0]`), and uses
it in the blocks and the head (`t.reshape(B, 6, -1)`, `out.reshape(B, -1, C)`). After capture
that read belongs to the embedding's layer, and the value it makes would cross from one layer to
another: a pipeline stage boundary (and the boundary the cost model cuts each layer out at),
which carries tensors only. A size is cheap to read again: its computation - shape and size
reads of the model's inputs, indexing, integer arithmetic - is copied into each layer that uses
it, before its first use there, reading the inputs again (a stage receives every input its
layers read). A size read from a tensor the model computes cannot be read again without that
tensor, so it is refused naming the node, the layer reading it and what to change.
"""
from __future__ import annotations

import torch
import torch.fx as fx


class SizeCrossingError(ValueError):
    """A size computed from a tensor of the model's is read in another layer."""


def copy_size_reads(gm: fx.GraphModule, owner: dict[str, str]) -> dict[str, str]:
    """Copy each size a layer reads from another layer into it (module docstring); `owner`
    (node name -> layer) is returned with the copies added, the originals no longer used
    erased."""
    owner = dict(owner)
    copies: dict[tuple[str, fx.Node], fx.Node] = {}
    for user in list(gm.graph.nodes):
        layer = owner.get(user.name)
        for arg in list(user.all_input_nodes):
            if layer is None or not _crossing_size(arg, layer, owner):
                continue
            user.replace_input_with(arg, _copy(gm, arg, user, layer, owner, copies))
    copied = {original for _, original in copies}
    for node in reversed(list(gm.graph.nodes)):  # the originals no layer reads any more
        if node in copied and not node.users:
            gm.graph.erase_node(node)
            owner.pop(node.name, None)
    return owner


def _is_size(node: fx.Node) -> bool:
    return not isinstance(node.meta.get("val"), torch.Tensor)


def _crossing_size(arg: fx.Node, layer: str, owner: dict[str, str]) -> bool:
    return arg.op not in ("placeholder", "get_attr") and owner.get(arg.name) not in (None, layer) \
        and _is_size(arg)


def _copy(gm, value: fx.Node, before: fx.Node, layer: str, owner: dict, copies: dict) -> fx.Node:
    """`value` computed again in `layer`, before `before`: inputs are read again, sizes copied."""
    if value.op == "placeholder" or owner.get(value.name) == layer:
        return value
    if (layer, value) in copies:
        return copies[(layer, value)]
    if not _is_size(value):
        raise SizeCrossingError(
            f"{before.name}, in layer {layer}, reads a size of {value.name}, a tensor computed in "
            f"layer {owner.get(value.name)}: read the size inside the layer that uses it (or "
            f"from the model's input), so that layers pass tensors only")
    args = {a: _copy(gm, a, before, layer, owner, copies) for a in value.all_input_nodes}
    with gm.graph.inserting_before(before):
        copy = gm.graph.node_copy(value, lambda a: args[a])
    copy.meta = dict(value.meta)
    owner[copy.name] = layer
    copies[(layer, value)] = copy
    return copy
