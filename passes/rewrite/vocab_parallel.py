"""Vocabulary-parallel rewrite of the embedding and the loss ("embed" / "head" layers with tp).

Embedding: each of the tp ranks holds a contiguous slice of the vocabulary rows. A token id is
looked up on the rank owning it; the other ranks look up row 0 of their slice and zero the result,
and an all-reduce (tp_all_reduce) sums the one real row into every rank:

    local = (ids - start).masked_fill(outside, 0);  y = tp_all_reduce(E_slice[local] * ~outside)

Loss: the logits projection becomes column-parallel (each rank computes the logits of its slice)
and cross_entropy becomes `vocab_parallel_cross_entropy`, which never gathers the full logits:
the row maximum and the sum of exponentials are all-reduced over tp (max, then sum), the target's
logit is taken on the rank owning it and all-reduced (sum). Backward is the exact gradient
softmax - one_hot, each rank writing its own slice.

A vocabulary that tp does not divide is padded (when asked) with zero rows up to the next
multiple: padded ids never occur, so those embedding rows are never read, and padded logits are
set to -inf before the softmax, so they never win and get no gradient: the loss is unchanged.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from passes.rewrite.sharding import (LAYER, ShardingError, ShardSpec, call_after, full_size, get_param,
                             linear_site, localize_shapes, nodes_by_layer, replace_param,
                             shard_of, tag_layers)
from passes.rewrite.tensor_parallel import make_column
from passes.rewrite.token_mean import cross_entropy_args
from runtime.comm import collectives

aten = torch.ops.aten
_EMBEDDING = {F.embedding, aten.embedding.default}
# Ops between the logits projection and the loss that only re-view the logits.
_VIEWS = {"flatten", "view", "reshape", "contiguous", torch.flatten, torch.reshape,
          aten.flatten.using_ints, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default}


def vocab_parallel(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]], tp: int, rank: int,
                   group: str = "tp", pad: bool = False, localize: bool = True
                   ) -> fx.GraphModule:
    """Shard the token embeddings and the cross-entropy logits of `layers` over tp ranks; in place.

    Token embeddings are the lookups whose indices are a graph input. `pad` allows a vocabulary
    that tp does not divide (see the module docstring); without it that is a ShardingError.
    `localize` as in tensor_parallel.
    """
    tag_layers(gm, layers)
    if tp == 1:
        return gm
    for layer, nodes in nodes_by_layer(gm, set(layers)).items():
        cut = False
        for node in nodes:
            lookup = _embedding(gm, node)
            if lookup is not None:
                _shard_embedding(gm, node, *lookup, layer, tp, rank, group, pad)
            elif _loss_args(gm, node) is not None:
                _shard_loss(gm, node, layer, tp, rank, group, pad)
            else:
                continue
            cut = True
        if not cut:  # planned as split, it would run whole: prices and memory untrue
            raise ShardingError(f"layer {layer}: not vocabulary-parallel: {_why_not(nodes)}; "
                                f"keep its strategy 'none'")
    gm.graph.lint()
    gm.recompile()
    if localize:
        localize_shapes(gm)
    return gm


def _why_not(nodes) -> str:
    """Why a layer has nothing to split: a lookup whose ids are not a model input as given (GPT-2
    reshapes its input_ids first), or neither a lookup nor a cross-entropy."""
    for node in nodes:
        if node.op == "call_function" and node.target in _EMBEDDING:
            ids = node.args[0] if node.target is F.embedding else node.args[1]
            if getattr(ids, "op", None) != "placeholder":
                return (f"its embedding lookup ({node.name}) takes ids computed from the "
                        f"inputs by {ids.name} ({getattr(ids.target, '__name__', ids.target)}), "
                        f"and the rewrite splits only lookups of a model input as given")
    return ("it has neither a token embedding (an embedding lookup of a model input) nor a "
            "cross-entropy over a linear's logits")


def _slice(vocab: int, what: str, layer: str, tp: int, rank: int, pad: bool):
    """(padding rows, rows per rank, first row of this rank)."""
    extra = -vocab % tp
    if extra and not pad:
        raise ShardingError(f"layer {layer}: {what} has a vocabulary of {vocab} (dim 0 of its "
                            f"weight), not divisible by tp={tp}; ask for vocabulary padding "
                            f"(Layout.pad_vocab / pad=True)")
    width = (vocab + extra) // tp
    return extra, width, rank * width


# ---------------------------------------------------------------- embedding


def _embedding(gm, node: fx.Node):
    """(ids node, weight path) of a token-embedding lookup, else None."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) is nn.Embedding and node.args[0].op == "placeholder":
            return node.args[0], f"{node.target}.weight"
        return None
    if node.op == "call_function" and node.target in _EMBEDDING:
        ids, weight = node.args[:2] if node.target is F.embedding else node.args[1::-1]
        if ids.op == "placeholder" and weight.op == "get_attr":
            return ids, weight.target
    return None


def _shard_embedding(gm, node, ids, weight, layer, tp, rank, group, pad) -> None:
    full = get_param(gm, weight)
    extra, width, start = _slice(full_size(full, 0), weight, layer, tp, rank, pad)
    shard = shard_of(full, ShardSpec(0, tp, rank, 1, extra), weight, layer)
    if node.op == "call_module":  # a new module: the traced one is the user's model's own
        gm.add_submodule(node.target, _embedding_slice(gm.get_submodule(node.target), shard,
                                                       start))
    else:
        replace_param(gm, weight, shard)
    graph = gm.graph
    with graph.inserting_before(node):
        shifted = graph.call_function(torch.sub, (ids, start))
        below = graph.call_function(torch.lt, (shifted, 0))
        above = graph.call_function(torch.ge, (shifted, width))
        outside = graph.call_function(torch.logical_or, (below, above))
        local = graph.call_function(torch.masked_fill, (shifted, outside, 0))
        rows = graph.call_function(torch.unsqueeze, (outside, -1))
    for new in (shifted, below, above, outside, local, rows):
        new.meta[LAYER] = layer
    node.replace_input_with(ids, local)
    zeroed = call_after(gm, node, torch.masked_fill, (rows, 0.0), layer)
    call_after(gm, zeroed, collectives.tp_all_reduce, (group, layer), layer)


def _embedding_slice(full: nn.Embedding, shard: nn.Parameter, start: int) -> nn.Embedding:
    index = full.padding_idx
    local = index - start if index is not None and 0 <= index - start < shard.shape[0] else None
    module = nn.Embedding(*shard.shape, padding_idx=local, max_norm=full.max_norm,
                          norm_type=full.norm_type, scale_grad_by_freq=full.scale_grad_by_freq,
                          sparse=full.sparse, device="meta")
    module.weight = shard
    return module


# ---------------------------------------------------------------- loss


# ... and casts of the logits (a float32 upcast before the loss), which work entry by entry
_VIEWS_AND_CASTS = _VIEWS | {"to", "float", aten.to.dtype, aten._to_copy.default,
                             aten.alias.default}


def _real_users(node: fx.Node) -> list[fx.Node]:
    """node's users but torch.export's metadata asserts (they check its dtype, not its use)."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _loss_args(gm, node: fx.Node):
    """(logits, target, ignore_index, reduction) of a cross-entropy node, else None."""
    found = cross_entropy_args(gm, node)
    if found is None:
        return None
    if found["weight"] is not None or found["label_smoothing"]:
        raise ShardingError(f"{node.name}: vocabulary-parallel cross-entropy supports neither "
                            f"class weights nor label smoothing")
    return found["logits"], found["target"], found["ignore_index"], found["reduction"]


def _shard_loss(gm, node: fx.Node, layer: str, tp: int, rank: int, group: str, pad: bool) -> None:
    logits, target, ignore_index, reduction = _loss_args(gm, node)
    source = logits
    while source.target in _VIEWS_AND_CASTS and len(_real_users(source)) == 1:
        source = source.args[0]
    site = linear_site(gm, source)
    if site is None or len(_real_users(source)) != 1:
        raise ShardingError(f"layer {layer}: the logits of {node.name} are not the output of a "
                            f"linear used only by the loss ({source.name}); a vocabulary-parallel "
                            f"loss needs the logits projection")
    vocab = site.features(gm, site.out_dim)
    extra, width, start = _slice(vocab, site.name, layer, tp, rank, pad)
    entry = call_after(gm, site.x, collectives.tp_copy, (group, layer), layer, replace=False)
    source.replace_input_with(site.x, entry)
    make_column(gm, linear_site(gm, source), layer, tp, rank, pad=extra)
    with gm.graph.inserting_before(node):
        loss = gm.graph.call_function(vocab_parallel_cross_entropy, (
            logits, target, start, vocab, ignore_index, reduction, group, layer))
    loss.meta = {**node.meta, LAYER: layer}
    node.replace_all_uses_with(loss)
    gm.graph.erase_node(node)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, vocab, ignore_index, reduction, group, tag):
        width = logits.shape[-1]
        real = max(0, min(width, vocab - start))  # columns of this slice inside the vocabulary
        x = logits.float()
        if real < width:  # padding columns never win
            x = x.masked_fill(torch.arange(width, device=x.device) >= real, float("-inf"))
        peak = collectives.all_reduce(x.amax(-1), group, tag, op="max")
        exp = (x - peak.unsqueeze(-1)).exp()
        total = collectives.all_reduce(exp.sum(-1), group, tag)
        local = target - start
        mine = (local >= 0) & (local < real)
        index = local.clamp(0, width - 1).unsqueeze(-1)
        picked = torch.where(mine, x.gather(-1, index).squeeze(-1) - peak, 0.0)
        picked = collectives.all_reduce(picked, group, tag)
        valid = target != ignore_index
        losses = (total.log() - picked).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), index, mine & valid, valid, count)
        if reduction == "none":
            return losses.to(logits.dtype)
        summed = losses.sum()
        return (summed / count if reduction == "mean" else summed).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        probs, index, hit, valid, count = ctx.saved_tensors
        scale = grad.float() / count if ctx.reduction == "mean" else grad.float()
        scale = scale.expand(valid.shape) * valid
        grad_logits = probs * scale.unsqueeze(-1)
        grad_logits.scatter_add_(-1, index, -(scale * hit).unsqueeze(-1))
        return grad_logits.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 vocab: int, ignore_index: int = -100, reduction: str = "mean",
                                 group: str = "tp", tag: str = "") -> torch.Tensor:
    """cross_entropy(full_logits, target) from this rank's logits slice [N, width] starting at
    vocabulary row `start` (of `vocab` real rows); identical on every rank of the group."""
    if collectives._active(logits, group):
        return _VocabParallelCrossEntropy.apply(logits, target, start, vocab, ignore_index,
                                                reduction, group, tag)
    if not collectives._fake(logits) and (start, logits.shape[-1]) != (0, vocab):
        raise RuntimeError(f"vocab_parallel_cross_entropy over a vocabulary slice needs group "
                           f"'{group}' bound (runtime.comm.collectives.bind_groups)")
    # Shapes only (fake tensors), or the whole vocabulary on this rank.
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
