"""Explicit attention masks under context parallelism: each rank's query rows of the whole mask.

A model builds its attention mask (padding, sliding windows, packed sequences; Hugging Face
models from the attention_mask input and the positions 0..seq-1) from per-token inputs. Under
context parallelism a rank holds only its own tokens, and the ring attends them to every rank's
keys, so the mask is needed for this rank's queries against the whole sequence. The nodes that
build the mask are copied to run on whole sequences:

  an input they read     -> collectives.whole_sequence(input): all-gathered over the cp group,
                            back in global order
  positions 0..seq-1     -> kept whole (the copies are marked, and the positions rewrite of
                            passes.rewrite.context_parallel leaves them alone)
  the mask [..., s, s]   -> index_select(mask, -2, this rank's global positions): [..., s/cp, s]

and runtime.context.ring_attention takes each block's columns from those rows. A mask computed from
anything but inputs, positions and constants (the model's activations or weights) is refused.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from passes.rewrite.sharding import LAYER, ancestors, get_param
from runtime.comm import collectives

WHOLE = "fxpar_cp_whole"   # node.meta flag: a copy that runs on the whole sequence


class MaskError(ValueError):
    """The mask is built from something other than inputs, positions and constants."""


def mask_rows(gm: fx.GraphModule, mask: fx.Node, positions: str, cp: int, group: str,
              layout: str, before: fx.Node) -> fx.Node:
    """A node, inserted before `before`, holding this rank's query rows of the whole `mask`;
    `positions` names the buffer of this rank's global token positions."""
    needed = builders(gm, mask)
    env: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(before):
        for node in gm.graph.nodes:
            if node not in needed or node.op == "get_attr":
                continue
            if node.op == "placeholder":
                env[node] = _whole_input(gm, node, cp, group, layout, mask.meta.get(LAYER))
                continue
            env[node] = gm.graph.node_copy(node, lambda n: env.get(n, n))
            env[node].meta = {**node.meta, WHOLE: True}
        rows = gm.graph.call_function(torch.index_select,
                                      (env[mask], -2, gm.graph.get_attr(positions)))
    rows.meta = {k: v for k, v in mask.meta.items() if k != "val"}
    return rows


def drop_unused(gm: fx.GraphModule) -> None:
    """Erase the nodes only torch.export's checks use (`_assert_tensor_metadata` of a value
    nothing else reads), and what fed only them: left over from building a mask on local
    tokens, they would now run on a rank's tokens with whole-sequence positions."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if _is_check(node) and all(_is_check(u) for a in node.all_input_nodes
                                       for u in a.users):
                gm.graph.erase_node(node)
                changed = True
        gm.graph.eliminate_dead_code()


def _is_check(node: fx.Node) -> bool:
    return node.op == "call_function" and str(getattr(node.target, "__name__", "")).startswith(
        "_assert_tensor_metadata")


def builders(gm: fx.GraphModule, mask: fx.Node) -> set[fx.Node]:
    """The nodes `mask` is computed from; MaskError when one reads weights or activations."""
    needed = ancestors(mask)
    for node in needed:
        val = node.meta.get("val")
        weight = node.op == "get_attr" and isinstance(get_param(gm, node.target), nn.Parameter)
        if node.op == "call_module" or weight or (
                isinstance(val, torch.Tensor) and val.requires_grad):
            raise MaskError(f"its attention mask {mask.name} is computed from {node.name}, "
                            f"which depends on the model's weights or activations (a mask is "
                            f"built on the whole sequence, from inputs and positions only)")
    return needed


def _whole_input(gm: fx.GraphModule, node: fx.Node, cp: int, group: str, layout: str,
                 layer: str | None) -> fx.Node:
    """The placeholder itself, or, for one cut on its sequence (every input of two or more
    dimensions: runtime.training.trainer.split_batch), its gathered whole sequence."""
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() >= 2):
        return node
    whole = gm.graph.call_function(collectives.whole_sequence, (node, group, layer or ""),
                                   {"parts": cp, "layout": layout})
    whole.meta = {WHOLE: True, **({LAYER: layer} if layer else {})}
    return whole

