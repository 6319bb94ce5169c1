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
                             linear_site, localize_shapes, nodes_by_layer, replace_module,
                             replace_param, shard_of, tag_layers)
from passes.rewrite.tensor_parallel import make_column
from passes.rewrite.token_mean import cross_entropy_args
from runtime.comm import collectives

aten = torch.ops.aten
_EMBEDDING = {F.embedding, aten.embedding.default}
# Ops between the logits projection and the loss that only re-view the logits.
_VIEWS = {"flatten", "view", "reshape", "contiguous", torch.flatten, torch.reshape,
          aten.flatten.using_ints, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default}
# Ops between a model input and a lookup that only re-shape the token ids, keeping every id and
# its value (GPT-2 and OPT look up `input_ids.view(-1, input_shape[-1])`); the ids' first
# argument is the tensor re-shaped. `_reshaped_input` checks each one on the graph.
_ID_RESHAPES = _VIEWS | {"unsqueeze", "squeeze", torch.unsqueeze, torch.squeeze,
                         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                         aten.squeeze.default, aten.alias.default}


def vocab_parallel(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]], tp: int, rank: int,
                   group: str = "tp", pad: bool = False, localize: bool = True
                   ) -> fx.GraphModule:
    """Shard the token embeddings and the cross-entropy logits of `layers` over tp ranks; in place.

    Token embeddings are the lookups whose indices are a graph input, as given or only re-shaped
    (view, reshape, flatten, unsqueeze, squeeze: every id kept); a weight tied to another name is
    cut under every name the graph does not read otherwise (`_retie`). `pad` allows a vocabulary
    that tp does not divide (see the module docstring); without it that is a ShardingError.
    `localize` as in tensor_parallel.
    """
    tag_layers(gm, layers)
    if tp == 1:
        return gm
    before = dict(gm.named_parameters(remove_duplicate=False))
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
    _retie(gm, before)
    gm.graph.lint()
    gm.recompile()
    if localize:
        localize_shapes(gm)
    return gm


def _why_not(nodes) -> str:
    """Why a layer has nothing to split: a lookup whose ids are computed from the inputs by an op
    that is not a re-shape (named), or neither a lookup nor a cross-entropy."""
    for node in nodes:
        ids = _lookup_ids(node)
        if ids is None:
            continue
        source, why = _reshaped_input(ids)
        if source is None:
            what = getattr(why.target, "__name__", why.target)
            return (f"its embedding lookup ({node.name}) takes ids computed from the "
                    f"inputs by {why.name} ({what}), and the rewrite splits only lookups of "
                    f"a model input as given or re-shaped (view, reshape, flatten, "
                    f"unsqueeze, squeeze)")
    return ("it has neither a token embedding (an embedding lookup of a model input) nor a "
            "cross-entropy over a linear's logits")


def _retie(gm: fx.GraphModule, before: Mapping[str, torch.Tensor]) -> None:
    """Point the other names of a weight this rewrite cut at its shard. A tied head's weight is
    one tensor under two names (GPT-2's transformer.wte.weight and lm_head.weight); torch.export
    reads it through one of them and keeps the other as a get_attr nothing uses, which the
    pipeline split still gives its stage: left whole, that name would hold the full vocabulary
    beside the shard (runtime.training.tied refuses the two as cut differently, and the cost
    model counts both). A name the graph reads is left as it is: its readers are not this
    rewrite's to change (runtime.training.tied checks that the copies are cut alike)."""
    now = dict(gm.named_parameters(remove_duplicate=False))
    read = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            read.add(str(node.target))
        elif node.op == "call_module":
            read.update(f"{node.target}.{name}" for name, _ in
                        gm.get_submodule(node.target).named_parameters(remove_duplicate=False))
    for path, old in before.items():
        new = now.get(path, old)
        if new is old or getattr(new, "fxpar_shard", None) is None:
            continue
        for alias, param in now.items():
            if param is old and alias not in read:
                replace_param(gm, alias, new)


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
    """(ids node, weight path) of a token-embedding lookup, else None: the ids are a model input,
    or one only re-shaped (`_reshaped_input`); the lookup reads them as they reach it."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) is nn.Embedding and isinstance(node.args[0], fx.Node) \
                and _reshaped_input(node.args[0])[0] is not None:
            return node.args[0], f"{node.target}.weight"
        return None
    if node.op == "call_function" and node.target in _EMBEDDING:
        ids, weight = node.args[:2] if node.target is F.embedding else node.args[1::-1]
        if isinstance(ids, fx.Node) and _reshaped_input(ids)[0] is not None \
                and weight.op == "get_attr":
            return ids, weight.target
    return None


def _lookup_ids(node: fx.Node):
    """The ids node an embedding lookup (module or function) reads, else None."""
    if node.op == "call_module" and node.graph.owning_module is not None:
        module = node.graph.owning_module.get_submodule(node.target)
        ids = node.args[0] if type(module) is nn.Embedding and node.args else None
    elif node.op == "call_function" and node.target in _EMBEDDING:
        ids = node.args[0] if node.target is F.embedding else node.args[1]
    else:
        return None
    return ids if isinstance(ids, fx.Node) else None


def _reshaped_input(ids: fx.Node) -> tuple[fx.Node | None, fx.Node]:
    """(the model input, the ids node) when `ids` is a placeholder or one re-shaped by
    _ID_RESHAPES only - each checked on the graph to keep every element (as many elements in as
    out where the capture recorded both, its other arguments sizes, not tensors); else (None,
    the first node on the way that is not such a re-shape), which the refusal names."""
    node = ids
    while node.op != "placeholder":
        if node.op not in ("call_function", "call_method") or node.target not in _ID_RESHAPES \
                or not node.args or not isinstance(node.args[0], fx.Node) \
                or not _keeps_every_element(node):
            return None, node
        node = node.args[0]
    return node, ids


def _keeps_every_element(node: fx.Node) -> bool:
    """A re-shape of node.args[0] that keeps every element: no other tensor argument (a
    `view(dtype)` reinterprets the bits, a tensor of sizes is not a size), the same element
    count and dtype in and out where the capture recorded both."""
    source = node.args[0]
    others = [*node.args[1:], *node.kwargs.values()]
    flat = [a for o in others for a in (o if isinstance(o, (list, tuple)) else (o,))]
    if any(isinstance(a, torch.dtype) for a in flat):
        return False
    if any(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
           for a in flat):
        return False
    out, given = node.meta.get("val"), source.meta.get("val")
    if isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor):
        return out.numel() == given.numel() and out.dtype == given.dtype
    return True


def _shard_embedding(gm, node, ids, weight, layer, tp, rank, group, pad) -> None:
    full = get_param(gm, weight)
    extra, width, start = _slice(full_size(full, 0), weight, layer, tp, rank, pad)
    shard = shard_of(full, ShardSpec(0, tp, rank, 1, extra), weight, layer)
    if node.op == "call_module":  # a new module: the traced one is the user's model's own
        module = gm.get_submodule(node.target)
        _no_max_norm(node, module.max_norm, layer)
        replace_module(gm, node.target, lambda: _embedding_slice(module, shard, start),
                       shard.fxpar_shard, layer)
    else:
        replace_param(gm, weight, shard)
        _localize_padding(node, full_size(full, 0), start, width, layer)
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


def _no_max_norm(node: fx.Node, max_norm, layer: str) -> None:
    """max_norm renormalises in place every row a lookup reads; a rank reads row 0 of its shard
    for the ids outside it (masked out after the lookup), which would renormalise a row no token
    read."""
    if max_norm is not None:
        raise ShardingError(f"layer {layer}: {node.name} looks up with max_norm={max_norm}, which "
                            f"renormalises the rows it reads in place; a vocabulary-parallel "
                            f"lookup reads rows for ids outside its shard too: keep the "
                            f"layer's strategy 'none'")


def _localize_padding(node: fx.Node, vocab: int, start: int, width: int, layer: str) -> None:
    """The lookup's padding row, whose gradient the backward leaves at zero, in the shard's own
    rows: the row it is on this rank, none elsewhere. Left global, a rank would leave the real
    row at that local index without its gradient. F.embedding takes None for none and counts a
    negative index from the end; aten.embedding takes -1 for none."""
    functional = node.target is F.embedding
    args, kwargs = list(node.args), dict(node.kwargs)
    none = None if functional else -1
    index = args[2] if len(args) > 2 else kwargs.get("padding_idx", none)
    if functional:
        _no_max_norm(node, args[3] if len(args) > 3 else kwargs.get("max_norm"), layer)
    if index is None or index == none and not functional:
        return
    index = index + vocab if functional and index < 0 else index
    local = index - start if 0 <= index - start < width else none
    if len(args) > 2:
        args[2] = local
    else:
        kwargs["padding_idx"] = local
    node.args, node.kwargs = tuple(args), kwargs


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
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
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
        grad = grad.to(probs.dtype)
        scale = grad / count if ctx.reduction == "mean" else grad
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
