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
  positions  torch.narrow(table, 0, 0, seq) or table[:seq] of a table indexed by position (GPT's
             position ids, Llama's rotary cos/sin) becomes torch.index_select(table, 0,
             cp_positions), where the buffer `cp_positions` holds this rank's global token
             positions; arange(seq) becomes those positions; seq may be written out or read off
             the input's shape (nanoGPT's arange(0, tokens.shape[1])). An arange or a table cut
             computed from the sequence length in another way (arange(1, t + 1), pos[1:t + 1]) is
             refused. A value built from constants over the whole sequence ([batch, seq, ...],
             OPT's cumulative sum of ones) is read at them where per-token values meet it.
             The graph is thereby specialised to the sequence length it was captured with.

The loss needs no rewrite here: passes.rewrite.token_mean divides it by the whole step's count of targets,
over every rank of the group. A mixture-of-experts balance loss is formed from per-sequence
statistics (expert counts, mean router scores): `passes.rewrite.expert_parallel.split_balance` makes each
MoE node sum them over the group first.

Every attention of the graph must be converted (a plain attention over local tokens would be
silently wrong), so attention outside `layers` or in a form not recognised is an error.
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

from passes.capture.trace import CONSTANT, propagate_shapes
from passes.rewrite import cp_sizes
from passes.rewrite.cp_tokens import (SequenceMixError, check_per_token, follow_dim,
                                     outside_attention)
from passes.rewrite.cp_masks import WHOLE, MaskError, builders, drop_unused, mask_rows
from passes.rewrite.expert_parallel import split_balance
from passes.rewrite.sharding import LAYER, get_param, is_sdpa, is_sink_attention
from passes.rewrite.tables import table
from runtime.training import rng
from runtime.programs.token_split import check_sequence, global_positions
from runtime.context.ring_attention import ring_attention

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SOFTMAX = {F.softmax, torch.softmax, "softmax"}
_MATMUL = {operator.matmul, torch.matmul, "matmul"}
POSITIONS_BUFFER = "cp_positions"


class ContextParallelError(ValueError):
    """The graph cannot be run context-parallel; names the attention node and the reason."""


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
    meets = cp_sizes.find(gm, seq, *outside_attention([a for a, _ in attentions]),
                          seeds=_position_seeds(gm, seq))
    for found, layer in attentions:
        if found.mask is not None and found.mask not in masks:
            _positions_buffer(gm, seq, cp, rank, layout)
            masks[found.mask] = mask_rows(gm, found.mask, POSITIONS_BUFFER, cp, group, layout,
                                          found.output)
        _replace(gm, found, group, layout, layer, masks.get(found.mask))
    split_balance(gm, cp, group)
    gm.graph.eliminate_dead_code()
    if masks:
        drop_unused(gm)
    _fix_positions(gm, seq, cp, rank, layout)
    _select_whole_constants(gm, seq, cp, rank, layout)
    if meets:
        _positions_buffer(gm, seq, cp, rank, layout)
        cp_sizes.localise(gm, meets, POSITIONS_BUFFER)
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
        pos = follow_dim(gm, 1, seq, lambda node, what: None,
                         *outside_attention([a for a, _ in found]))
        found = [(a, layer) for a, layer in found if a.k in pos or a.v in pos]
        try:
            check_per_token(gm, seq, [attention for attention, _ in found])
        except SequenceMixError as err:
            raise ContextParallelError(str(err)) from None
    return found


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
            if len(shape) >= 2 and shape[1] == seq:
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


# ---------------------------------------------------------------- positions


def _fix_positions(gm: fx.GraphModule, seq: int, cp: int, rank: int, layout: str) -> None:
    """A table's first seq entries along a dim (narrow(table, d, 0, seq), table[:seq]) ->
    index_select(table, d, this rank's global positions); arange(seq) (position ids built in the
    graph, as Hugging Face and nanoGPT models do) -> those positions. seq written out is the
    captured length; read off the input's shape (tokens.shape[1]) it is, at run time, this rank's
    length: both are rewritten. An arange or a table cut that the sequence length sizes or places
    in any other way (arange(1, t + 1), pos[1:t + 1]) is refused: left as it is it would
    silently be computed from this rank's token count."""
    for node in list(gm.graph.nodes):
        if node.meta.get(WHOLE):  # builds a mask on the whole sequence (passes.rewrite.cp_masks)
            continue
        if _is_position_range(node, seq):
            _positions_buffer(gm, seq, cp, rank, layout)
            with gm.graph.inserting_before(node):
                positions = gm.graph.get_attr(POSITIONS_BUFFER)
                if node.meta["val"].dtype != torch.int64:
                    positions = gm.graph.call_method("to", (positions, node.meta["val"].dtype))
            _tag_like(node, positions)
            positions.meta["val"] = node.meta["val"]  # the whole sequence's: views localised
            node.replace_all_uses_with(positions)
            gm.graph.erase_node(node)
            continue
        dim = _position_prefix(node, seq)
        if dim is None:
            _check_not_positions(node, seq)
            continue
        _positions_buffer(gm, seq, cp, rank, layout)
        # One read of the buffer per use, next to it, like the model's own tables: a pipeline
        # split then keeps it in the stage of its user instead of sending it across stages.
        with gm.graph.inserting_before(node):
            positions = gm.graph.get_attr(POSITIONS_BUFFER)
            rows = gm.graph.call_function(torch.index_select, (node.args[0], dim, positions))
        _tag_like(node, rows)
        rows.meta["val"] = node.meta["val"]  # the whole sequence's: views of it localised
        node.replace_all_uses_with(rows)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()  # the size reads that fed them


def _position_seeds(gm: fx.GraphModule, seq: int) -> dict[fx.Node, int]:
    """The aranges and table cuts _fix_positions makes the rank's positions: node -> the dim
    of its positions."""
    seeds = {node: 0 for node in gm.graph.nodes if _is_position_range(node, seq)}
    return seeds | {node: dim for node in gm.graph.nodes
                    if (dim := _position_prefix(node, seq)) is not None}


def _check_not_positions(node: fx.Node, seq: int) -> None:
    """Refuse an arange or a table cut, not rewritten, whose bounds are computed from the
    sequence length: on each rank they would be computed from that rank's share of tokens."""
    if _takes_positions(node) and _from_sequence(node.all_input_nodes, seq):
        raise ContextParallelError(
            f"node {node.name} = {_form(node)} is computed from the sequence length t but is "
            f"not a form context parallel rewrites to this rank's positions (arange(t), "
            f"table[:t], narrow(table, dim, 0, t), t read off the input as tokens.shape[1] or "
            f"off a value whose only dim of that size is the sequence): each rank would "
            f"silently compute it from its t/cp tokens as if they were the whole sequence")


def _tag_like(node: fx.Node, new: fx.Node) -> None:
    """Put `new` and the nodes it reads that were just inserted (the buffer read) in `node`'s
    layer: an arange of positions may be the graph's first node once the size reads it took
    are gone, and an untagged node there has no neighbour to take a pipeline stage from."""
    if LAYER in node.meta:
        for inserted in (new, *new.all_input_nodes):
            if inserted is new or (inserted.op, inserted.target) == ("get_attr", POSITIONS_BUFFER):
                inserted.meta[LAYER] = node.meta[LAYER]


def _select_whole_constants(gm: fx.GraphModule, seq: int, cp: int, rank: int,
                            layout: str) -> None:
    """A value built in the graph from constants alone over the whole sequence ([batch, seq,
    ...]: OPT's positions, a cumulative sum of ones) is read at this rank's tokens
    (index_select on dim 1) where per-token values meet it. Values computed from this rank's
    positions are local already, and the whole-sequence mask builders stay whole."""
    local = set()
    for node in gm.graph.nodes:
        if (node.op == "get_attr" and node.target == POSITIONS_BUFFER) or any(
                a in local for a in node.all_input_nodes):
            local.add(node)
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if not (node.meta.get(CONSTANT) and not node.meta.get(WHOLE) and node not in local
                and isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[1] == seq):
            continue
        readers = [u for u in node.users if not u.meta.get(CONSTANT) or u in local]
        if not readers:
            continue
        _positions_buffer(gm, seq, cp, rank, layout)
        with gm.graph.inserting_after(node):
            positions = gm.graph.get_attr(POSITIONS_BUFFER)
        with gm.graph.inserting_after(positions):
            mine = gm.graph.call_function(torch.index_select, (node, 1, positions))
        mine.meta = {k: v for k, v in node.meta.items() if k == LAYER}
        for reader in readers:
            reader.replace_input_with(node, mine)


def _positions_buffer(gm: fx.GraphModule, seq: int, cp: int, rank: int, layout: str) -> None:
    if not hasattr(gm, POSITIONS_BUFFER):
        device = next((t.device for t in gm.state_dict().values()), torch.device("cpu"))
        gm.register_buffer(POSITIONS_BUFFER, table(global_positions(seq, cp, rank, layout, "cpu"),
                                                   device),
                           persistent=False)


_ARANGE = {torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
           torch.ops.aten.arange.start_step}
_CUTS = {torch.narrow, "narrow", operator.getitem, torch.ops.aten.slice.Tensor}


def _is_position_range(node: fx.Node, seq: int) -> bool:
    """arange(0, seq, 1): the positions of a whole sequence. With seq written out only of
    integers (a float range of that length may as well be frequencies over a head dimension);
    with seq read off the sequence dim of a shape, of any dtype (sinusoidal positions)."""
    if not _is_call(node, _ARANGE):
        return False
    start, end, step = _range_bounds(node)
    val = node.meta.get("val")
    if (start, step) != (0, 1) or not isinstance(val, torch.Tensor):
        return False
    written = not any(isinstance(a, fx.Node) for a in (*node.args, start, end, step))
    return (written and end == seq and not val.dtype.is_floating_point) or \
        _reads_sequence(end, seq)


def _range_bounds(node: fx.Node) -> tuple:
    """(start, end, step) of an arange, passed by position (arange(end), arange(start, end[,
    step])) or by keyword."""
    names = ("end",) if len(node.args) == 1 else ("start", "end", "step")
    bounds = {"start": 0, "step": 1} | dict(zip(names, node.args)) | dict(node.kwargs)
    return bounds["start"], bounds.get("end"), bounds["step"]


def _position_prefix(node: fx.Node, seq: int) -> int | None:
    """The dim d when `node` is a parameter's or buffer's first seq entries along d; else None.
    Along any dim when seq is read off the sequence dim of a shape; along dim 0 also whenever
    seq rows are taken, however the length is written (a table's rows by position: seq written
    out, torch.export's slice, the presets' narrow whose length is read off q in the attention,
    where heads or head_dim may equal seq)."""
    cut = _cut(node)
    if cut is None:
        return None
    dim, start, length, step = cut
    val = node.meta.get("val")
    rows = dim == 0 and isinstance(val, torch.Tensor) and val.dim() > 0 and val.shape[0] == seq
    if start in (0, None) and step in (1, None) and (rows or _reads_sequence(length, seq)):
        return dim
    return None


def _cut(node: fx.Node) -> tuple | None:
    """(dim, start, length, step) of a parameter or buffer cut along one dim: narrow(table, dim,
    start, length), or table[start:stop:step] on one dim and whole on the others (the length is
    stop when start is 0, all _position_prefix needs) - torch.export writes it aten.slice(table,
    dim, start, stop, step); None for anything else."""
    if not (_is_call(node, _CUTS) and _is_table(node.args[0])):
        return None
    if node.target is torch.ops.aten.slice.Tensor:
        return (*node.args[1:], *(0, None, None, 1)[len(node.args) - 1:])
    if node.target != operator.getitem:
        return (*node.args[1:4], 1) if len(node.args) == 4 else None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    cuts = [d for d, part in enumerate(index) if part != slice(None)]
    if len(cuts) != 1 or not all(isinstance(part, slice) for part in index):
        return None
    part = index[cuts[0]]
    return cuts[0], part.start, part.stop, part.step


def _takes_positions(node: fx.Node) -> bool:
    """An arange, or a part of a parameter or buffer: what positions are made of."""
    return _is_call(node, _ARANGE) or (_is_call(node, _CUTS) and _is_table(node.args[0]))


def _is_table(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


def _reads_sequence(node, seq: int) -> bool:
    """`node` is the sequence length read off a shape: of an input at dim 1 (the dim every
    input is cut on), or of another value at its only dim of seq entries."""
    read = _size_read(node)
    return read is not None and _sequence_dim(*read, seq) is True


def _from_sequence(nodes, seq: int) -> bool:
    """Whether one of the numbers `nodes` is computed from a size of seq read off a shape."""
    todo, seen = list(nodes), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        read = _size_read(node)
        if read is not None:
            if _sequence_dim(*read, seq) is not False:
                return True
        elif isinstance(node.meta.get("val"), (int, float, torch.SymInt)):  # arithmetic on sizes
            todo.extend(node.all_input_nodes)
    return False


def _size_read(node) -> tuple[fx.Node, int] | None:
    """(x, d) of x.shape[d], x.size(d), x.size()[d] or aten.sym_size.int(x, d); else None."""
    if _is_method(node, "size") or _is_call(node, {torch.ops.aten.sym_size.int}):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        return (node.args[0], dim) if isinstance(dim, int) else None
    if not (_is_call(node, {operator.getitem}) and isinstance(node.args[1], int)):
        return None
    shape = node.args[0]
    if (_is_method(shape, "size") and len(shape.args) == 1 and not shape.kwargs) or \
            (_is_call(shape, {getattr}) and shape.args[1] == "shape"):
        return shape.args[0], node.args[1]
    return None


def _sequence_dim(x, dim: int, seq: int) -> bool | None:
    """Whether dim `dim` of x is the sequence: True at dim 1 of an input and at the only dim of
    seq entries of any other value; None where other dims hold seq entries too (they cannot be
    told apart: [batch, seq, hidden] with batch = seq); False where it holds another size."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and -val.dim() <= dim < val.dim()
            and val.shape[dim] == seq):
        return False
    if x.op == "placeholder":
        return dim % val.dim() == 1
    return True if list(val.shape).count(seq) == 1 else None


def _form(node: fx.Node) -> str:
    """The call as code with its arguments named: "arange(0, sub, 1)", "pos[1:add]"."""
    if node.target == operator.getitem:
        return f"{_source(node.args[0])}[{_source(node.args[1])}]"
    name = getattr(node.target, "__name__", node.target)
    return f"{name}({', '.join(map(_source, node.args))})"


def _source(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, slice):
        parts = (arg.start, arg.stop) if arg.step is None else (arg.start, arg.stop, arg.step)
        return ":".join("" if a is None else _source(a) for a in parts)
    if isinstance(arg, tuple):
        return ", ".join(map(_source, arg))
    return repr(arg)


# ---------------------------------------------------------------- helpers


def _is_call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and \
        node.target in targets


def _is_method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _dim_arg(softmax: fx.Node):
    return softmax.kwargs.get("dim", softmax.args[1] if len(softmax.args) > 1 else None)


def _fail(node: fx.Node, reason: str):
    raise ContextParallelError(
        f"cannot make attention {node.name} context-parallel: {reason}. Context parallel needs "
        f"F.scaled_dot_product_attention (no dropout) or the form "
        f"softmax(q @ k.transpose(-2, -1) * scale [.masked_fill(causal, -inf)]) @ v")
