"""Tensor-parallel rewrite (Megatron pairing) of the linear layers of chosen layers.

Within a layer, walking nodes in order, every tensor is either replicated or sharded on its
feature / head dimension. A linear whose input is replicated becomes column-parallel (its output
features are split, so its output is sharded); a linear whose input is sharded becomes row-parallel
(its input features are split, its output is a partial sum). Any other op with a sharded input gives
a sharded output — heads never mix in attention, and the MLP activation is elementwise.

Linears are recognised in every form `passes.rewrite.sharding.linear_site` knows (modules, F.linear,
addmm / Conv1D, matmul by a weight, torch.export's aten ops); weights read by get_attr are replaced
by their shard in place.

Grouped-query attention whose kv heads do not divide by tp keeps the k and v projections whole on
every rank and selects, per rank, the kv heads its own query heads read (a narrow, or an
index_select repeating them when the grouping is uneven); the gradients of those replicated
weights, partial on each rank, are summed by tp_grad_sum. A projection of the queries fused with
such kv heads and split into sized parts (GPT-BigCode's multi-query c_attn) is kept whole the same
way, and each rank takes its query heads from the query part, its kv heads from the others.

Collectives inserted, as named call nodes:
  tp_copy(x)        before each column-parallel linear (identity forward, all-reduce backward)
  tp_all_reduce(y)  after each row-parallel linear, before its bias is added
  tp_grad_sum(w)    on the weights of replicated k/v projections (uneven GQA only), and on
                    whole parameters applied to sharded values (per-head q/k norms)
  tp_gather(y)      after a column-parallel linear whose output is needed whole (a DiT's adaLN
                    modulation, cut into parts that scale and shift replicated values:
                    passes.rewrite.tp_gather says why that is exact and what it costs)
  tp_sum(s)         after a sum or mean over the sharded features (passes.rewrite.tp_dataflow finds
                    them: an RMSNorm over all heads, OLMo-2's q/k norms), a mean then divided
                    by tp; that norm's weight is sharded like the features
so each attention and MLP pair costs one all-reduce forward and one backward, and each norm over
all heads one more of each. A constant per head built outside the layer (BLOOM's ALiBi bias) is
read per rank: unflatten / narrow / flatten to the rank's heads, no communication; a whole value
per head with a gradient (T5's relative position bias, from a trained embedding) the same way
after a tp_copy, whose backward all-reduce sums the ranks' parts of its gradient.

Inserted nodes are tagged with their layer; afterwards node.meta["val"] holds local shapes
(`passes.rewrite.sharding.localize_shapes`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.trace import CONSTANT
from passes.rewrite.grad_sums import module_params_summed
from passes.rewrite.sharding import (_RESHAPES, LAYER, PARTS, LinearSite, ShardingError, ShardSpec,
                             after_views, before_views, call_after, get_param,
                             is_attention, is_sdpa, lift_params, linear_site, localize_shapes,
                             nodes_by_layer, replace_module, replace_param, shard_of, shard_outputs,
                             shard_param, shard_specs, tag_layers)
from passes.rewrite.fused_parts import fused_cut
from passes.rewrite.tables import table
from passes.rewrite.tp_convs import cut_depthwise
from passes.rewrite.tp_dataflow import check_layer
from passes.rewrite.tp_gather import gather_column
from passes.rewrite.value_sources import trained_param
from passes.rewrite.weight_pieces import cut_splits
from runtime.comm import collectives
from runtime.training import rng

aten = torch.ops.aten
# ShardingError, ShardSpec and shard_specs are imported from here by the planner and the runtime.
__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardSpec", "ShardingError",
           "make_column", "shard_specs", "tensor_parallel"]


class ColumnParallelLinear(nn.Linear):
    """Holds its output-row shard (and bias shard). A Linear, so op pricing sees its local shape."""

    def __init__(self, full: nn.Linear, spec: ShardSpec):
        nn.Module.__init__(self)
        self.in_features = full.in_features
        self.out_features = (full.out_features + spec.pad) // spec.parts
        self.weight = shard_param(full.weight, spec)
        self.bias = shard_param(full.bias, spec) if full.bias is not None else None


class RowParallelLinear(nn.Linear):
    """Holds its input-column shard; the bias (replicated) is added in the graph after the reduce."""

    def __init__(self, full: nn.Linear, spec: ShardSpec):
        nn.Module.__init__(self)
        self.in_features, self.out_features = full.in_features // spec.parts, full.out_features
        self.weight = shard_param(full.weight, spec)
        self.bias = full.bias

    # A Linear computing x @ weight.T without its bias: cost rules price it as a linear.
    fxpar_linear = True

    def forward(self, x):
        return F.linear(x, self.weight)


def tensor_parallel(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]], tp: int, rank: int,
                    group: str = "tp", params: Mapping[str, torch.Tensor] | None = None,
                    localize: bool = True) -> fx.GraphModule:
    """Shard the linears of `layers` (layer name -> its node names) over `tp` ranks; in place.

    `params` gives the values of weights that are graph inputs (placeholders of a lifted export
    graph): they become parameters of gm and are sharded like the others. `localize=False` leaves
    node.meta["val"] (and literal view sizes) to a later `localize_shapes`, for a caller that
    applies several rewrites and propagates shapes once.
    """
    tag_layers(gm, layers)
    if tp == 1:
        return gm
    lift_params(gm, params or {})
    for layer, nodes in nodes_by_layer(gm, set(layers)).items():
        _shard_layer(gm, layer, nodes, tp, rank, group)
    gm.graph.lint()
    gm.recompile()
    if localize:
        localize_shapes(gm)
    return gm


def _shard_layer(gm, layer: str, nodes: list[fx.Node], tp: int, rank: int, group: str) -> None:
    replicated = _grouped_kv(gm, layer, nodes, tp, rank)
    found = check_layer(gm, layer, nodes, tp, set(replicated))
    for view, parts in found.parted_views.items():  # localize_shapes cuts their heads
        view.meta[PARTS] = parts
    for conv in found.depthwise:  # their weights and biases cut just below
        cut_depthwise(gm, conv, tp)
    for path, dim in found.cut_params.items():  # weights of norms over all heads' features
        replace_param(gm, path, shard_of(get_param(gm, path), ShardSpec(dim, tp, rank), path,
                                         layer))
    copies: dict[fx.Node, fx.Node] = {}  # whole values with a gradient -> their tp_copy
    for (user, whole), (dim, heads) in found.sliced.items():  # values per head (ALiBi, T5)
        if (user, whole) in found.copied:
            whole = _copy_once(gm, user, whole, copies, layer, group)
        _take_heads(gm, user, whole, dim, heads, tp, rank, layer)
    for reader, operand in found.shares.copies:  # passes.rewrite.tp_grad_paths
        _copy_once(gm, reader, operand, copies, layer, group)
    for reader, operand in found.shares.shares:
        with gm.graph.inserting_before(reader):
            share = gm.graph.call_function(collectives.tp_grad_share, (operand, group, layer))
        share.meta = {**operand.meta, LAYER: layer}
        reader.replace_input_with(operand, share)
    sharded: set[fx.Node] = set()
    selected: set[fx.Node] = set()  # kv heads taken from a replicated projection: already local
    entries: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        site = linear_site(gm, node)
        if site is not None and site.x in sharded:
            _make_row(gm, site, layer, tp, rank, group)
        elif node in found.whole:  # as in one process, on every rank (Findings.whole)
            continue
        elif site is not None:
            value, reader = before_views(site.x, node)
            if value not in entries:  # one region entry per value (q, k, v share it)
                entries[value] = call_after(gm, value, collectives.tp_copy, (group, layer), layer,
                                            replace=False)
                for user in list(value.users):  # size reads inside the region see the entry
                    if not isinstance(user.meta.get("val"), torch.Tensor) and user.users:
                        user.replace_input_with(value, entries[value])
            reader.replace_input_with(value, entries[value])
            site = linear_site(gm, node)
            if node in replicated:
                _refuse_piece(site, layer, "kv heads kept whole")
                taken = _make_replicated(gm, site, layer, replicated[node], group)
                sharded.update(taken)
                selected.update(taken)
            elif node in found.gathered:  # needed whole (a DiT's modulation): tp_gather
                _refuse_piece(site, layer, "one gathered whole")
                gather_column(gm, site, layer, tp, rank, group)
            else:
                make_column(gm, site, layer, tp, rank, parts=found.parted.get(node))
                sharded.add(node)
        elif node in found.reduced:  # partial over the sharded features: whole once summed
            _sum_over_group(gm, node, found.reduced[node], layer, tp, group)
        elif any(arg in sharded for arg in node.all_input_nodes):
            if all(arg in selected for arg in node.all_input_nodes if arg in sharded):
                selected.add(node)
            else:
                _check_heads(node, layer, tp)
            wholes = found.broadcast.get(node, ())
            node = _sum_replicated_grads(gm, node, layer, group, set(found.cut_params))
            for whole in wholes:  # those from parameters alone were summed just above
                if whole in node.all_input_nodes:
                    _copy_once(gm, node, whole, copies, layer, group)
            _own_dropout(gm, node)
            sharded.add(node)
    if not (sharded or found.gathered or found.cut_params or found.depthwise):
        _refuse_unsplit(gm, layer, nodes, found, tp)


def _refuse_unsplit(gm, layer: str, nodes: list[fx.Node], found, tp: int) -> None:
    """A layer of which nothing was split would run whole on every rank of its tp group while
    its plan says tensor-parallel: refused, saying why nothing was."""
    whole = [n.name for n in nodes if n in found.whole]
    why = (f"its linears ({', '.join(whole)}) have output features that tp={tp} does not "
           f"divide, so each stays whole" if whole else
           f"it holds no linear (nn.Linear, F.linear, or x @ w.T of a 2-D parameter) to split: "
           f"write its products with weights so (not einsum or bmm)")
    raise ShardingError(f"layer {layer}: not tensor-parallel: {why}; under tp it would run "
                        f"whole on every rank")


_DROPOUTS = {torch.ops.aten.dropout.default, F.dropout}


def _own_dropout(gm, node: fx.Node) -> None:
    """A dropout of a sharded value draws from this tp rank's own stream (runtime.training.rng): each
    shard drops independently, while dropouts of whole values (every tp rank holds the same)
    keep the default stream, seeded alike across the group."""
    if is_sdpa(node):  # a fused dropout inside: the same call, drawn from the tp stream
        dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        if dropout:
            node.target = rng.tp_scaled_dot_product_attention
        return
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Dropout):
        p, train = gm.get_submodule(node.target).p, True
    elif node.op == "call_function" and node.target in _DROPOUTS:
        args = dict(zip(("input", "p", "train"), node.args)) | dict(node.kwargs)
        p, train = args.get("p", 0.5), args.get("train", args.get("training", True))
    else:
        return
    node.op, node.target = "call_function", rng.tp_dropout
    node.args, node.kwargs = (node.args[0], p, train), {}


def _take_heads(gm, user: fx.Node, whole: fx.Node, dim: int, heads: int, tp: int, rank: int,
                layer: str) -> None:
    """`user` reads this rank's heads of `whole`, a constant whose dimension `dim` holds `heads`
    heads (innermost: BLOOM's ALiBi bias is [batch x heads, 1, seq]): viewed as (-1, heads),
    narrowed to the rank's block, flattened back."""
    local = heads // tp
    graph = gm.graph
    with graph.inserting_before(user):
        split = graph.call_function(torch.unflatten, (whole, dim, (-1, heads)))
        mine = graph.call_function(torch.narrow, (split, dim + 1, rank * local, local))
        taken = graph.call_function(torch.flatten, (mine, dim, dim + 1))
    for new in (split, mine, taken):
        new.meta = {LAYER: layer, **({CONSTANT: True} if whole.meta.get(CONSTANT) else {})}
    user.replace_input_with(whole, taken)


def _copy_once(gm, user: fx.Node, whole: fx.Node, copies: dict, layer: str,
               group: str) -> fx.Node:
    """`whole` read through tp_copy (one per value and layer): a whole value with a gradient
    (T5's position bias) of which each rank takes its heads, so that the gradient coming back -
    on each rank its heads' part - is summed over the group, whole again for what computed it."""
    if whole not in copies:
        with gm.graph.inserting_before(user):
            copies[whole] = gm.graph.call_function(collectives.tp_copy, (whole, group, layer))
        copies[whole].meta = {**whole.meta, LAYER: layer}
    elif not _comes_before(copies[whole], user):  # made for a later reader first
        user.prepend(copies[whole])
    user.replace_input_with(whole, copies[whole])
    return copies[whole]


def _comes_before(node: fx.Node, other: fx.Node) -> bool:
    """Whether `node` precedes `other` in their graph."""
    while node.op != "root":
        if node is other:
            return False
        node = node.next
        if node is other:
            return True
    return False


def _sum_over_group(gm, node: fx.Node, op: str, layer: str, tp: int, group: str) -> None:
    """The sum (or mean) of this rank's features becomes the whole layer's: all-reduced over the
    group (and the gradient too, tp_sum), a mean of tp equal parts then divided by tp."""
    summed = call_after(gm, node, collectives.tp_sum, (group, layer), layer)
    if op == "mean":
        call_after(gm, summed, torch.div, (tp,), layer)


def _sum_replicated_grads(gm, node: fx.Node, layer: str, group: str,
                          cut: set[str] = frozenset()) -> fx.Node:
    """A whole parameter applied to a sharded value (a per-head q/k norm's weight, Gemma's
    `1 + weight`, a per-head scale) gets on each rank only its heads' part of the gradient: read
    it, or the value computed from parameters alone, through tp_grad_sum, which sums it over the
    group."""
    if node.op == "call_module":  # a norm module of a symbolic trace: its own parameters,
        # unless cut like the value (a depthwise convolution's)
        if any(f"{node.target}.{name}" in cut for name, _ in
               gm.get_submodule(node.target).named_parameters()):
            return node
        return module_params_summed(gm, node, layer, group)
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and arg.target in cut:  # sharded like the value: its own grad
            continue
        if arg.target is not collectives.tp_grad_sum and _from_params_only(gm, arg):
            with gm.graph.inserting_before(node):
                summed = gm.graph.call_function(collectives.tp_grad_sum, (arg, group, layer))
            summed.meta = {**arg.meta, LAYER: layer}
            node.replace_input_with(arg, summed)
    return node


def _from_params_only(gm, node: fx.Node) -> bool:
    """Computed from constants and at least one trained parameter, from no input."""
    seen, stack, trained = set(), [node], False
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder" or len(seen) > 64:  # an activation, or too far to be one
            return False
        if current.target is collectives.tp_copy:  # each rank's part: its gradient summed there
            return False
        if current.op == "get_attr":
            trained = trained or trained_param(gm, current)
        stack.extend(current.all_input_nodes)
    return trained


def make_column(gm, site: LinearSite, layer: str, tp: int, rank: int, pad: int = 0,
                parts: int | None = None) -> None:
    """Split the output features of a linear over tp ranks (after `pad` zero rows, for vocab);
    a fused projection (its chunk or split, or `parts` its view found) per part."""
    if site.piece is not None:
        return _make_column_piece(gm, site, layer, tp, rank, parts or 1)
    cut = fused_cut(site.node)
    if cut is not None and not cut.equal:  # unequal parts (Phi-3's q, k, v): each cut apart
        cut.localize(tp, layer)
        spec = ShardSpec(site.out_dim, tp, rank, sizes=cut.sizes)
        return shard_outputs(gm, site, spec, ColumnParallelLinear, layer)
    chunks = cut.parts if cut else parts or 1
    width = site.features(gm, site.out_dim)
    if (width + pad) % (chunks * tp):
        parts = f" in {chunks} parts" if chunks > 1 else ""
        raise ShardingError(f"layer {layer}: {site.name} has {width} output features (dim "
                            f"{site.out_dim} of its weight){parts}, not divisible by tp={tp}")
    shard_outputs(gm, site, ShardSpec(site.out_dim, tp, rank, chunks, pad), ColumnParallelLinear,
                  layer)
    if cut:  # each part shrinks with the shard
        cut.localize(tp, layer)


def _make_column_piece(gm, site: LinearSite, layer: str, tp: int, rank: int, parts: int) -> None:
    """A linear whose weight is a piece of a parameter cut in the graph
    (passes.rewrite.weight_pieces): the parameter cut per part, the split per rank."""
    piece, node = site.piece, site.node.name
    if piece.unit % tp:
        raise ShardingError(f"layer {layer}: {node} multiplies by a piece of {site.weight}, "
                            f"split into {list(piece.sizes)} rows in the graph, parts of "
                            f"{piece.unit} rows that tp={tp} does not divide")
    if piece.parts != parts:
        raise ShardingError(f"layer {layer}: {node} multiplies by a piece of {site.weight} that "
                            f"covers {piece.parts} parts of {piece.unit} rows, but its output is "
                            f"read as {parts} (view it as ({piece.parts}, {piece.unit}) to take "
                            "each part's heads)")
    spec = ShardSpec(0, tp, rank, sum(piece.sizes) // piece.unit)
    for path in filter(None, (site.weight, site.bias)):
        replace_param(gm, path, shard_of(get_param(gm, path), spec, path, layer))
    cut_splits(piece, tp)


def _refuse_piece(site: LinearSite, layer: str, as_what: str) -> None:
    if site.piece is not None:
        raise ShardingError(f"layer {layer}: {site.node.name} multiplies by a piece of "
                            f"{site.weight} cut in the graph, which fxpar cuts for a "
                            f"column-parallel linear only, not {as_what}")


def _make_row(gm, site: LinearSite, layer: str, tp: int, rank: int, group: str) -> None:
    _refuse_piece(site, layer, "a row-parallel one (its input sharded)")
    in_dim = 1 - site.out_dim
    width = site.features(gm, in_dim)
    if width % tp:
        raise ShardingError(f"layer {layer}: {site.name} has {width} input features (dim {in_dim} "
                            f"of its weight), not divisible by tp={tp}")
    spec, node = ShardSpec(in_dim, tp, rank), site.node
    if site.module is not None:
        replace_module(gm, node.target, lambda: RowParallelLinear(site.module, spec), spec, layer)
    else:
        replace_param(gm, site.weight, shard_of(get_param(gm, site.weight), spec, site.weight,
                                                layer))
        site.drop_bias()
    reduced = call_after(gm, after_views(node), collectives.tp_all_reduce, (group, layer), layer)
    if site.bias is not None:
        with gm.graph.inserting_after(reduced):
            bias = gm.graph.get_attr(site.bias)
        bias.meta[LAYER] = layer
        call_after(gm, bias, torch.add, (bias,), layer, value=reduced)


def _make_replicated(gm, site: LinearSite, layer: str, select, group: str) -> fx.Node:
    """A k/v projection kept whole: its weights' gradients summed, then this rank's heads taken."""
    node, graph = site.node, gm.graph
    with graph.inserting_before(node):
        params = [graph.get_attr(p) for p in (site.weight, site.bias) if p is not None]
        summed = [graph.call_function(collectives.tp_grad_sum, (p, group, layer)) for p in params]
        if site.out_dim == 1:  # [in, out] weight: x @ W (+ b)
            linear = graph.call_function(torch.matmul, (site.x, summed[0]))
            if len(summed) > 1:
                linear = graph.call_function(torch.add, (linear, summed[1]))
        else:
            linear = graph.call_function(F.linear, (site.x, *summed))
    for new in (*params, *summed, linear, *linear.all_input_nodes):
        new.meta.setdefault(LAYER, layer)
    linear.meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(linear)
    graph.erase_node(node)
    if isinstance(select, FusedTake):  # the queries' and the kv heads' parts, each its own
        return [_select(gm, part, select.of(part), layer) for part in select.parts(linear)]
    return [_select(gm, linear, select, layer)]


def _select(gm, value: fx.Node, select, layer: str) -> fx.Node:
    """This rank's part of the last dimension of `value`: (start, length), or indices."""
    if isinstance(select, torch.Tensor):
        name = f"{value.name}_heads"
        gm.register_buffer(name, table(select, value.meta["val"].device), persistent=False)
        with gm.graph.inserting_after(value):
            index = gm.graph.get_attr(name)
        index.meta[LAYER] = layer
        return call_after(gm, index, torch.index_select, (-1, index), layer, value=value)
    return call_after(gm, value, torch.narrow, (-1, *select), layer)


@dataclass(frozen=True)
class FusedTake:
    """A projection of the queries fused with kv heads that tp does not divide (GPT-BigCode's
    multi-query c_attn), kept whole: each part of its split takes this rank's query heads (a
    block) or the kv heads they read."""

    q_width: int
    q: tuple[int, int]
    kv: object              # (start, length) or indices, as _kv_selection gives

    def of(self, part: fx.Node):
        return self.q if part.meta["val"].shape[-1] == self.q_width else self.kv

    @staticmethod
    def parts(linear: fx.Node) -> list[fx.Node]:
        split = fused_split(linear)
        return sorted(split.users, key=lambda g: g.args[1])


def fused_split(linear: fx.Node) -> fx.Node | None:
    """The split into sized parts of the last dimension that `linear`'s output reaches through
    views (BigCode's `c_attn(x).unsqueeze(1).split((E, kv, kv), dim=3)`), read only by getitems."""
    node = linear
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target in ("split", torch.split, aten.split_with_sizes.default, aten.split.Tensor):
            sizes, dim = user.args[1], user.kwargs.get("dim", user.args[2] if len(user.args) > 2
                                                       else 0)
            ndim = node.meta["val"].dim()
            if isinstance(sizes, (list, tuple)) and dim % ndim == ndim - 1 and all(
                    u.target is operator.getitem for u in user.users):
                return user
            return None
        if user.target not in ("unsqueeze", aten.unsqueeze.default, *_RESHAPES):
            return None
        node = user
    return None


def _grouped_kv(gm, layer: str, nodes: list[fx.Node], tp: int, rank: int) -> dict:
    """k/v projections whose heads do not divide by tp -> what this rank takes of their output:
    (start, length) of the last dimension, or a tensor of indices."""
    mine, result = set(nodes), {}
    for node in filter(is_attention, nodes):  # SDPA or sink attention: (q, k, v, ...)
        q, k, v = node.args[:3]
        q_heads, kv_heads = q.meta["val"].shape[-3], k.meta["val"].shape[-3]
        if q_heads % tp:
            raise ShardingError(f"layer {layer}: {q_heads} query heads (dim 1 of {q.name}) are not "
                                f"divisible by tp={tp}")
        if kv_heads % tp == 0:
            continue
        q_sites = _sources(gm, q, mine)
        for value in (k, v):
            sites = _sources(gm, value, mine)
            head_dim = value.meta["val"].shape[-1]
            take = _kv_selection(q_heads, kv_heads, head_dim, tp, rank)
            if sites and sites & q_sites:
                take = _fused_take(sites, q_heads, kv_heads, head_dim, tp, rank, take)
            if not sites or take is None:
                raise ShardingError(f"layer {layer}: {kv_heads} kv heads (dim 1 of {value.name}) "
                                    f"are not divisible by tp={tp}, and their projection is fused "
                                    f"with the queries' in a way not split by sized parts")
            result.update(dict.fromkeys(sites, take))
    return result


def _fused_take(sites: set[fx.Node], q_heads: int, kv_heads: int, head_dim: int, tp: int,
                rank: int, kv) -> FusedTake | None:
    """How a rank reads a fused q/kv projection split into parts of q and kv widths; None when
    it is not one."""
    if len(sites) != 1:
        return None
    split = fused_split(next(iter(sites)))
    q_width, kv_width, local = q_heads * head_dim, kv_heads * head_dim, q_heads // tp
    if split is None or sorted(split.args[1]).count(q_width) != 1 or \
            any(w not in (q_width, kv_width) for w in split.args[1]):
        return None
    return FusedTake(q_width, (rank * local * head_dim, local * head_dim), kv)


def _kv_selection(q_heads: int, kv_heads: int, head_dim: int, tp: int, rank: int):
    local, group = q_heads // tp, q_heads // kv_heads
    needed = [(rank * local + i) // group for i in range(local)]
    if local % group == 0 or group % local == 0:  # each kv head taken serves equally many q heads
        return needed[0] * head_dim, len(set(needed)) * head_dim
    # Uneven: one kv head per query head (repeated), so the grouping ratio becomes 1.
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in needed])


def _sources(gm, value: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    """The linears of the layer that `value` is computed from."""
    found, seen, stack = set(), set(), [value]
    while stack:
        node = stack.pop()
        if node in seen or node not in within:
            continue
        seen.add(node)
        if linear_site(gm, node) is not None:
            found.add(node)
        else:
            stack.extend(node.all_input_nodes)
    return found


def _check_heads(node: fx.Node, layer: str, tp: int) -> None:
    """Splitting features into heads must not cut a head: the local width must hold whole heads."""
    if node.target not in ("unflatten", aten.unflatten.int) or node.args[1] != -1:
        return
    sizes, source = node.args[2], node.args[0].meta.get("val")
    if sizes[0] == -1 and source is not None and (source.shape[-1] // tp) % sizes[1]:
        raise ShardingError(f"layer {layer}: {source.shape[-1] // sizes[1]} heads (dim -1 of "
                            f"{node.args[0].name}, {sizes[1]} wide) are not divisible by tp={tp}")
