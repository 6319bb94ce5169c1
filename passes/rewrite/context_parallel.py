"""Context-parallel rewrite: each rank of the cp group holds a slice of every sequence.

The batch is cut on its sequence dimension (`runtime.programs.token_split`, zig-zag by default), so all per-token
work (embeddings, norms, MLPs, the loss) is local as it stands. Two things see across tokens and are
rewritten, in place:

  attention  F.scaled_dot_product_attention (is_causal, or an explicit attn_mask, of which each
             rank gets its query rows of the whole sequence's mask: passes.rewrite.cp_masks), or its
             written-out form
               softmax(q @ kᵀ * scale [.masked_fill(causal mask, -inf)]) [dropout, p=0] @ v
             becomes a call of `runtime.context.ring_attention.ring_attention(q, k, v, group, causal=...,
             layout=..., scale=..., tag=layer)`; a grouped k/v repeated by repeat_interleave on the
             head dimension is passed unrepeated (the ring sends the smaller blocks).
  positions  what the graph indexes by position is read at this rank's global positions
             (passes.rewrite.cp_positions): a table's first seq rows, arange(seq), values built
             from constants over the whole sequence, and values computed from no input that span
             it where they meet the rank's tokens (a rotary table read whole, a learned position
             parameter). The graph is thereby specialised to the sequence length it was
             captured with.

The loss needs no rewrite here: passes.rewrite.token_mean divides it by the whole step's count of targets,
over every rank of the group. A mixture-of-experts balance loss is formed from per-sequence
statistics (expert counts, mean router scores): `passes.rewrite.expert_parallel.split_balance` makes each
MoE node sum them over the group first.

Every attention whose keys and values hold the sequence must be converted (a plain attention
over local tokens would be silently wrong), so such attention outside `layers` or in a form not
recognised is an error. Inputs of another length than the first (a timestep, a context) are whole
on every rank, and an attention over keys and values made from them stays as it is.
Run it on the whole captured graph (after tensor_parallel, before the pipeline split): node
meta["val"] is recomputed afterwards for the local sequence length, which the split and pricing use.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.trace import propagate_shapes
from passes.rewrite.cp_positions import (POSITIONS_BUFFER, ContextParallelError, computed_from,
                                         fix_positions, is_call as _is_call, is_method as _is_method,
                                         position_seeds, positions_buffer, read_at_positions,
                                         select_whole_constants, whole_meets)
from passes.rewrite.cp_tokens import SequenceMixError, check_per_token, outside_attention
from passes.rewrite.cp_masks import MaskError, builders, drop_unused, mask_rows
from passes.rewrite.expert_parallel import split_balance
from passes.rewrite.sharding import get_param, is_sdpa, is_sink_attention
from runtime.training import rng
from runtime.programs.token_split import check_sequence, holds_sequence
from runtime.context.ring_attention import ring_attention

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SOFTMAX = {F.softmax, torch.softmax, "softmax"}
_MATMUL = {operator.matmul, torch.matmul, "matmul"}

@dataclass(frozen=True)
class Attention:
    """One attention found in the graph, reduced to what the ring needs."""

    output: fx.Node          # the node whose value is the attention output
    q: fx.Node
    k: fx.Node
    v: fx.Node
    causal: bool
    scale: float | None      # None: 1/sqrt(head_dim)
    mask: fx.Node | None = None   # an explicit attn_mask (passes.rewrite.cp_masks)


def context_parallel(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]], cp: int, rank: int,
                     group: str = "cp", layout: str = "zigzag",
                     localize: bool = True) -> fx.GraphModule:
    """Rewrite the attention of `layers` (layer name -> its node names) as ring attention over the
    `cp` ranks of the group named `group`, and positions for this `rank`'s tokens; in place.
    localize=False leaves shape propagation to the caller (passes.stages.program does it once, after
    every pass, from `local_inputs`)."""
    if cp == 1:
        return gm
    seq = _sequence_length(gm)
    check_sequence(seq, cp, layout)
    masks: dict[fx.Node, fx.Node] = {}   # a mask shared by every layer is built once
    attentions = find_attentions(gm, layers)
    meets = whole_meets(gm, seq, *outside_attention([a for a, _ in attentions]),
                          seeds=position_seeds(gm, seq))
    for found, layer in attentions:
        if found.mask is not None and found.mask not in masks:
            positions_buffer(gm, seq, cp, rank, layout)
            masks[found.mask] = mask_rows(gm, found.mask, POSITIONS_BUFFER, cp, group, layout,
                                          found.output)
        _replace(gm, found, group, layout, layer, masks.get(found.mask))
    split_balance(gm, cp, group)
    gm.graph.eliminate_dead_code()
    if masks:
        drop_unused(gm)
    fix_positions(gm, seq, cp, rank, layout)
    select_whole_constants(gm, seq, cp, rank, layout)
    if meets:
        positions_buffer(gm, seq, cp, rank, layout)
        read_at_positions(gm, meets)
    gm.graph.lint()
    gm.recompile()
    if localize:
        propagate_shapes(gm, local_inputs(gm, cp))
    return gm


def find_attentions(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]],
                    seq: int | None = None) -> list[tuple[Attention, str]]:
    """Every attention of the graph whose keys and values hold the sequence, with its layer;
    ContextParallelError when the graph cannot run with its sequence split (an attention in an
    unknown form or outside `layers`, labels shifted inside the graph). An attention over keys
    and values every rank holds whole (cross-attention to a context of another length) is
    exact on the rank's queries as it stands. `seq`: the model's sequence length (default: dim
    1 of the graph's first input, which a layer's graph may not hold). Reads the graph only."""
    seq = seq or _sequence_length(gm)
    _check_no_shift(gm, seq)
    layer_of = {name: layer for layer, names in layers.items() for name in names}
    found = []
    for node in gm.graph.nodes:
        attention = _find_attention(gm, node)
        if attention is None:
            continue
        if node.name not in layer_of:
            raise ContextParallelError(
                f"attention {node.name} is in no layer given to context_parallel; with the "
                f"sequence sharded every attention must become a ring attention")
        found.append((attention, layer_of[node.name]))
    if found:  # else none to ring: said as such (why_not)
        tokens = _from_tokens(gm, seq)
        found = [(a, layer) for a, layer in found if a.k in tokens or a.v in tokens]
        try:
            check_per_token(gm, seq, [attention for attention, _ in found])
        except SequenceMixError as err:
            raise ContextParallelError(str(err)) from None
    return found


def _from_tokens(gm: fx.GraphModule, seq: int) -> set[fx.Node]:
    """The nodes computed from an input that is cut along the sequence (holds_sequence):
    an attention whose keys and values are not among them reads what every rank holds whole.
    (Ancestry, not where follow_dim finds the sequence: a sequence merged with the batch and
    viewed back is still the rank's tokens, and must go round the ring.)"""
    return computed_from(gm, {node for node in gm.graph.nodes if node.op == "placeholder"
                              and holds_sequence(node.meta.get("val"), seq)})


def why_not(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]]) -> str | None:
    """None when context_parallel can rewrite this graph, else the reason it cannot."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and "masked_scatter" in str(node.target):
            return (f"{node.name} (masked_scatter) fills the positions a mask selects, in order "
                    f"over the whole sequence (image features merged into the token "
                    f"embeddings): a rank holding part of each sequence would fill its "
                    f"positions from the first features; plan with cp=1")
    try:
        _check_token_lengths(gm, _sequence_length(gm))
        return None if find_attentions(gm, layers) else (
            "the graph has no attention to ring: context parallel needs "
            "F.scaled_dot_product_attention or softmax(q @ "
            "k.transpose(-2, -1) * scale [masked causal]) @ v, and this model's attention is "
            "neither (soft-capped scores, a position bias such as ALiBi); plan with cp=1")
    except ContextParallelError as err:
        return str(err)


def _check_token_lengths(gm: fx.GraphModule, seq: int) -> None:
    """Every input is cut on dim 1 into the same 2·cp chunks (runtime.training.trainer), and only
    those of the first input's length are localised: a sequence of tokens of another length (an
    encoder-decoder's decoder tokens, shorter than the encoder's) would be cut at other places
    than the graph assumes."""
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() >= 2 and not val.is_floating_point() \
                and val.shape[1] != seq:
            raise ContextParallelError(
                f"input {node.name} holds {val.shape[1]} tokens per sample and the first input "
                f"{seq}: context parallel splits every sequence of the batch into the same "
                f"chunks, so they must be equally long (an encoder-decoder's decoder tokens as "
                f"many as the encoder's); plan with cp=1")


def _sequence_length(gm: fx.GraphModule) -> int:
    """The captured sequence length: dim 1 of the first [batch, seq, ...] input."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ContextParallelError(
                    f"input {node.name} has no shape; capture the model (passes.capture.trace) first")
            if val.dim() >= 2:
                return int(val.shape[1])
    raise ContextParallelError("no [batch, seq] input: cannot tell the sequence length")


def local_inputs(gm: fx.GraphModule, cp: int) -> tuple:
    """Zero inputs of the captured shapes with the sequence dimension cut to seq / cp."""
    seq = _sequence_length(gm)
    inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            shape = list(val.shape)
            if holds_sequence(val, seq):
                shape[1] = seq // cp
            inputs.append(torch.zeros(shape, dtype=val.dtype, device=val.device))
    return tuple(inputs)


def _check_no_shift(gm: fx.GraphModule, seq: int) -> None:
    """A model that shifts its labels inside the graph (logits[:, :-1] against labels[:, 1:], or
    labels padded by one and sliced, as Hugging Face causal LMs do) pairs each token with its
    neighbour, which under a split sequence may live on another rank: refuse rather than train on
    wrong pairs. Seen as a node that turns a sequence of seq positions into seq ± 1."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() >= 2
                and val.shape[1] in (seq - 1, seq + 1)):
            continue
        source = next((a for a in node.all_input_nodes
                       if isinstance(a.meta.get("val"), torch.Tensor)
                       and a.meta["val"].dim() >= 2 and a.meta["val"].shape[1] == seq), None)
        if source is not None:
            raise ContextParallelError(
                f"node {node.name} shifts the sequence ({source.name} has {seq} positions, "
                f"{node.name} {val.shape[1]}): under context parallelism the shift would cross rank "
                f"boundaries. Pass next-token labels as an input and take the loss position by "
                f"position, or plan with cp=1")


# ---------------------------------------------------------------- attention


def _find_attention(gm: fx.GraphModule, node: fx.Node) -> Attention | None:
    if is_sdpa(node):
        return _sdpa(gm, node)
    if is_sink_attention(node):  # run over local tokens it would be silently wrong
        _fail(node, "ring attention has no attention sinks or sliding window yet "
                    "(fxpar.sink_attention, GPT-OSS's attention); plan with cp=1")
    if node.op in ("call_function", "call_method") and node.target in _SOFTMAX:
        return _math(gm, node)
    return None


def _sdpa(gm: fx.GraphModule, node: fx.Node) -> Attention:
    args = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
    if args.get("dropout_p", 0.0):
        _fail(node, f"attention dropout (dropout_p={args['dropout_p']}) is not supported")
    mask = args.get("attn_mask")
    if mask is not None:
        try:
            builders(gm, mask)
        except MaskError as err:
            _fail(node, str(err))
    return Attention(node, args["query"], args["key"], args["value"],
                     bool(args.get("is_causal", False)), args.get("scale"), mask)


def _math(gm: fx.GraphModule, softmax: fx.Node) -> Attention | None:
    """softmax(q @ kᵀ * c [masked causal]) @ v; None when the softmax is not over q @ kᵀ."""
    scores, causal = softmax.args[0], False
    if _is_method(scores, "masked_fill"):
        mask, value = scores.args[1], scores.args[2]
        if value != float("-inf") or not _is_causal_mask(gm, mask):
            _fail(softmax, "written-out attention masks other than the causal mask are not "
                  "supported")
        scores, causal = scores.args[0], True
    scale = 1.0
    if _is_call(scores, {operator.mul, operator.truediv, torch.mul, "mul", "div"}):
        scores, scale = _scaled(softmax, scores)
    if not _is_call(scores, _MATMUL):
        return None
    if _dim_arg(softmax) not in (-1, 3):
        _fail(softmax, "the softmax must be over the last (key) dimension")
    q, key_t = scores.args
    if not (_is_method(key_t, "transpose") and {*key_t.args[1:]} in ({-2, -1}, {2, 3})):
        _fail(softmax, "the scores must be q @ k.transpose(-2, -1)")
    probs = _skip_dropout(gm, softmax)
    if len(probs.users) != 1:
        _fail(softmax, "the attention probabilities are used more than once")
    (out,) = probs.users
    if not (_is_call(out, _MATMUL) and out.args[0] is probs):
        _fail(softmax, "the attention probabilities must be multiplied by v")
    return Attention(out, q, unrepeated(key_t.args[0]), unrepeated(out.args[1]), causal, scale)


def _scaled(softmax: fx.Node, scores: fx.Node) -> tuple[fx.Node, float]:
    """(tensor, scale) of `tensor * c`, `c * tensor` or `tensor / c` with a constant c."""
    first, second = scores.args
    multiply = scores.target in (operator.mul, torch.mul, "mul")
    tensor, factor = (second, first) if multiply and not isinstance(first, fx.Node) else \
        (first, second)
    if not isinstance(tensor, fx.Node) or isinstance(factor, fx.Node):
        _fail(softmax, "the attention scale must be a constant")
    return tensor, float(factor) if multiply else 1.0 / float(factor)


def _skip_dropout(gm: fx.GraphModule, softmax: fx.Node) -> fx.Node:
    users = list(softmax.users)
    if len(users) == 1 and users[0].op == "call_module":
        module = gm.get_submodule(users[0].target)
        if isinstance(module, nn.Dropout):
            if module.p and module.training:
                _fail(softmax, f"attention dropout (p={module.p}) is not supported")
            return users[0]
    if len(users) == 1 and users[0].op == "call_function" and users[0].target is rng.tp_dropout:
        p, train = users[0].args[1:3]   # a dropout the tensor-parallel rewrite made per rank
        if p and train:
            _fail(softmax, f"attention dropout (p={p}) is not supported")
        return users[0]
    return softmax


def unrepeated(node: fx.Node) -> fx.Node:
    """x.repeat_interleave(n, dim=1) (grouped K/V repeated to the query heads) -> x."""
    if _is_method(node, "repeat_interleave"):
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if dim == 1:
            return node.args[0]
    return node


def _is_causal_mask(gm: fx.GraphModule, mask) -> bool:
    """A prefix (narrow from 0 on dims 0/1) of a constant upper-triangular boolean buffer."""
    while isinstance(mask, fx.Node) and mask.op == "call_function" and mask.target is torch.narrow:
        if mask.args[1] not in (0, 1) or mask.args[2] != 0:
            return False
        mask = mask.args[0]
    if not (isinstance(mask, fx.Node) and mask.op == "get_attr"):
        return False
    table = get_param(gm, mask.target)
    if table.dim() != 2 or table.dtype != torch.bool:
        return False
    if table.is_meta:  # a model built on the meta device holds no values to check
        return True
    return bool(torch.equal(table, torch.ones_like(table).triu(1)))


def _replace(gm: fx.GraphModule, found: Attention, group: str, layout: str, layer: str,
             mask: fx.Node | None = None) -> None:
    kwargs = {"causal": found.causal, "layout": layout, "scale": found.scale, "tag": layer}
    if mask is not None:
        kwargs["mask"] = mask
    with gm.graph.inserting_before(found.output):
        ring = gm.graph.call_function(ring_attention, (found.q, found.k, found.v, group), kwargs)
    ring.meta = dict(found.output.meta)
    found.output.replace_all_uses_with(ring)
    gm.graph.erase_node(found.output)  # dead-code elimination keeps an sdpa (it may draw dropout)


# ---------------------------------------------------------------- helpers


def _dim_arg(softmax: fx.Node):
    return softmax.kwargs.get("dim", softmax.args[1] if len(softmax.args) > 1 else None)


def _fail(node: fx.Node, reason: str):
    raise ContextParallelError(
        f"cannot make attention {node.name} context-parallel: {reason}. Context parallel needs "
        f"F.scaled_dot_product_attention (no dropout) or the form "
        f"softmax(q @ k.transpose(-2, -1) * scale [.masked_fill(causal, -inf)]) @ v")
