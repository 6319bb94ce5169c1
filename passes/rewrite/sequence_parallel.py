"""Megatron sequence parallelism for layers already rewritten tensor-parallel ("tp+sp").

Outside its tensor-parallel regions a TP layer computes the same values on every rank (norms,
dropout, residual adds). Sequence parallelism splits those along the sequence (dimension `dim` of
[batch, seq, hidden]) instead, so each rank keeps 1/tp of them:

  tp_copy(x)        -> sp_all_gather(x)       gather the sequence before each column-parallel block
  tp_all_reduce(y)  -> sp_reduce_scatter(y)   sum and split it after each row-parallel block

An all-gather whose users are all linears becomes one `sp_gather_linear` node, which keeps only the
local slice for backward (and gathers it again there) - Megatron's way of not storing the gathered
input of every column-parallel linear.

Activations between two SP layers stay sharded, also across pipeline stages. At a boundary with a
layer that is not SP, a resharding node is inserted, owned by the non-SP layer: `sp_scatter`
(no communication forward) after a replicated value an SP layer reads, `sp_gather` before a non-SP
layer reads a sharded value. Inside an SP layer, a replicated value combined with a sharded one
(a position table added to a sharded embedding, say) is scattered along its sequence dimension.
Replicated parameters applied to sequence shards (norm weights, the bias added after a
reduce-scatter) get only the local tokens' part of their gradient on each rank; they are read
through tp_grad_sum (a module's through `with_params`), which sums it over the group - the extra
all-reduce Megatron does for those parameters.

Only per-token work may sit between the regions: attention (sdpa, or a matmul of two sharded
activations) there is a ShardingError, as is a sequence that tp does not divide.
"""
from __future__ import annotations

import operator
from typing import Collection, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from passes.rewrite.cp_tokens import pads, transforms
from passes.rewrite.expert_parallel import sequence_refusal
from passes.capture.trace import CONSTANT
from passes.rewrite.grad_sums import module_params_summed, with_params  # noqa: F401
from passes.rewrite.sharding import LAYER, ShardingError, is_attention, localize_shapes, tag_layers
from runtime.comm import collectives as c

_LINEAR = {F.linear, torch.ops.aten.linear.default}
# Ops that work along one dimension they are given, and the position of that argument: along
# the sequence, each would see only its rank's tokens (a softmax or cumsum over the sequence, a
# concatenation or split of it); they are refused there (_along_sequence).
_DIM_AT = {"cat": 1, "concat": 1, "concatenate": 1, "stack": 1, "split": 2, "chunk": 2,
           "tensor_split": 2, "split_with_sizes": 2, "unbind": 1, "narrow": 1, "select": 1,
           "index_select": 1, "gather": 1, "cumsum": 1, "cumprod": 1, "cummax": 1,
           "logcumsumexp": 1, "softmax": 1, "log_softmax": 1, "_softmax": 1, "sort": 1,
           "argsort": 1, "topk": 2, "flip": 1, "roll": 2, "sum": 1, "mean": 1, "amax": 1,
           "amin": 1, "max": 1, "min": 1, "prod": 1, "var": 1, "std": 1, "logsumexp": 1,
           "argmax": 1, "argmin": 1, "median": 1, "diff": 2, "movedim": 1, "transpose": 1,
           "swapaxes": 1, "unflatten": 1, "repeat_interleave": 2}
_MATMUL = {torch.matmul, torch.bmm, "matmul", "bmm", torch.ops.aten.matmul.default,
           torch.ops.aten.bmm.default}


def sequence_parallel(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]],
                      sp: Collection[str], tp: int, group: str = "tp", dim: int = 1,
                      localize: bool = True, cp: int = 1) -> fx.GraphModule:
    """Run the layers named in `sp` sequence-parallel over tp ranks; in place. `layers` lists every
    layer's nodes (boundaries need the neighbours); run after the tensor-parallel rewrites, on
    shapes either local or still full (`localize` as in tensor_parallel). With context parallel
    over cp ranks (applied after this pass), each rank's 1/cp of the sequence is what tp splits."""
    tag_layers(gm, layers)
    if tp == 1 or not sp:
        return gm
    refusal = sequence_refusal(gm, [layers[name] for name in sp if name in layers], sp=True)
    if refusal:
        raise ShardingError(f"sequence parallel: {refusal}")
    walk = _Walk(gm, frozenset(sp), tp, group, dim, cp)
    for node in list(gm.graph.nodes):
        walk.visit(node)
    for node in list(gm.graph.nodes):
        if node.target is c.sp_all_gather:
            _fuse_linears(gm, node)
    gm.graph.lint()
    gm.recompile()
    if localize:
        localize_shapes(gm)
    return gm


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


class _Walk:
    """Marks sequence-sharded values in graph order and inserts the collectives they need."""

    def __init__(self, gm, sp, tp, group, dim, cp=1):
        self.gm, self.sp, self.tp, self.group, self.dim, self.cp = gm, sp, tp, group, dim, cp
        self.sharded: set[fx.Node] = set()
        self.scattered: dict[fx.Node, fx.Node] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.summed: dict[fx.Node, fx.Node] = {}
        self.out_shape: dict[str, set[tuple]] = {}  # each SP layer's outputs (its streams)

    def visit(self, node: fx.Node) -> None:
        if node.op in ("placeholder", "get_attr"):
            return
        layer = node.meta.get(LAYER)
        if layer not in self.sp or node.op == "output":
            for arg in node.all_input_nodes:
                if arg in self.sharded:
                    node.replace_input_with(arg, self._gather(arg, node, layer))
            return
        for arg in node.all_input_nodes:
            if (arg.meta.get(LAYER) not in self.sp and arg.op not in ("placeholder", "get_attr")
                    and _floating(arg) and self._carries_sequence(arg, layer)):
                self._check(arg, layer, self.dim)  # named after the SP layer that needs it
                node.replace_input_with(arg, self._scatter(arg, arg.meta.get(LAYER)))
        if node.target is c.tp_copy and node.args[0] in self.sharded:
            self._convert(node, c.sp_all_gather, layer)
        elif node.target is c.tp_all_reduce:
            self.sharded.add(self._convert(node, c.sp_reduce_scatter, layer))
        elif node.target is not c.tp_grad_sum and self._reads_sharded(node):
            self._align(node, layer)
            self.sharded.add(self._sum_param_grads(node, layer))

    def _sum_param_grads(self, node: fx.Node, layer: str) -> fx.Node:
        """A replicated parameter applied to a sequence shard gets only this shard's part of its
        gradient: read it through tp_grad_sum (a module's parameters through `with_params`)."""
        graph = self.gm.graph
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and isinstance(_attr(self.gm, arg.target), nn.Parameter):
                with graph.inserting_before(node):
                    summed = graph.call_function(c.tp_grad_sum, (arg, self.group, layer))
                summed.meta = {**arg.meta, LAYER: layer}
                node.replace_input_with(arg, summed)
        if node.op != "call_module":
            return node
        return module_params_summed(self.gm, node, layer, self.group)

    def _reads_sharded(self, node: fx.Node) -> bool:
        if not any(arg in self.sharded for arg in node.all_input_nodes):
            return False
        mixing = is_attention(node) or (node.target in _MATMUL
                                   and all(a in self.sharded for a in node.all_input_nodes[:2]))
        if mixing:
            raise ShardingError(f"layer {node.meta.get(LAYER)}: {node.name} mixes tokens of "
                                f"sequence shards; sequence parallelism needs it inside a "
                                f"tensor-parallel region")
        if not isinstance(node.meta.get("val"), torch.Tensor):
            return False
        self._per_token(node)
        return True

    def _per_token(self, node: fx.Node) -> None:
        """Each rank runs `node` on its tokens only: exact only if it works token by token. It
        must keep the sequence dimension, as long as in every sequence-sharded value it reads
        (a concatenation, split or slice along the sequence, or a reduction over it, would
        join or cut each rank's shards instead of the sequence), and take no dimension
        argument that names the sequence (a softmax or cumsum along it keeps its length)."""
        out, dim = node.meta["val"], self.dim
        op = _op_name(node)
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg not in self.sharded or not isinstance(val, torch.Tensor):
                continue
            changed = out.dim() <= dim or val.dim() <= dim or val.shape[dim] != out.shape[dim]
            if changed or _along_sequence(node, op, val.dim(), dim) or \
                    pads(self.gm, node, val.dim(), dim) or transforms(node, op, val.dim(), dim):
                what = (f"gives {tuple(out.shape)} from {arg.name} {tuple(val.shape)}, the "
                        f"sequence (dim {dim}) changed" if changed else
                        f"works along the sequence (dim {dim}) of {arg.name}")
                raise ShardingError(
                    f"layer {node.meta.get(LAYER)}: {node.name} ({op}) {what}; under sequence "
                    f"parallelism each rank holds 1/{self.tp} of the tokens, so it would run on "
                    f"a shard instead of the sequence: move it out of the block, or plan the "
                    f"layer with strategy=tp")

    def _carries_sequence(self, value: fx.Node, layer: str) -> bool:
        """Whether a value entering `layer` from outside is a stream the layer continues (shaped
        as one of its outputs: the hidden state, or each stream of a block with two, as Flux's
        image and text), to be split along the sequence as it enters - as it arrives from the
        block before, whose outputs leave sequence-sharded. Any other - a conditioning vector
        every block reads, rotary tables, a cross-attention context - enters whole and meets
        the sequence shards only where _align takes it."""
        if layer not in self.out_shape:
            def leaves(n):  # a node of the layer read outside it
                return any(u.op == "output" or u.meta.get(LAYER) != layer for u in n.users)
            outs = (n.meta.get("val") for n in self.gm.graph.nodes if n.meta.get(LAYER) == layer
                    and n.op not in ("placeholder", "get_attr") and leaves(n))
            self.out_shape[layer] = {tuple(v.shape) for v in outs if isinstance(
                v, torch.Tensor) and v.is_floating_point() and v.dim() > self.dim}
        shapes = self.out_shape[layer]
        return not shapes or tuple(value.meta["val"].shape) in shapes

    def _align(self, node: fx.Node, layer: str) -> None:
        """Scatter replicated operands that carry the sequence dimension of the output; those
        broadcast along it are read through tp_grad_sum, for each rank's part of their gradient
        comes from its own tokens only (as for the replicated parameters)."""
        out = node.meta["val"]
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg in self.sharded or not isinstance(val, torch.Tensor) or not val.dim():
                continue
            seq_dim = self.dim - (out.dim() - val.dim())
            if seq_dim >= val.dim():
                # the output has no sequence dimension left (a reduction over it, or inputs
                # that are not sequences), so no operand can be matched to its shards
                op = getattr(node.target, "__name__", node.target)
                raise ShardingError(f"layer {layer}: {node.name} ({op}) gives "
                                    f"{tuple(out.shape)}, without the sequence dimension "
                                    f"{self.dim} of the shards it reads: not per-token work, "
                                    f"which sequence parallelism needs")
            if seq_dim < 0 or val.shape[seq_dim] == 1:  # the same on every shard
                if val.is_floating_point() and arg.op != "get_attr" and \
                        not arg.meta.get(CONSTANT):
                    node.replace_input_with(arg, self._grad_summed(arg, layer, node))
                continue
            if val.shape[seq_dim] != out.shape[self.dim]:
                raise ShardingError(f"layer {layer}: {node.name} combines sequence shards with "
                                    f"{arg.name}, whose dim {seq_dim} is not the sequence")
            node.replace_input_with(arg, self._scatter(arg, layer, seq_dim, before=node))

    def _grad_summed(self, value: fx.Node, layer: str, before: fx.Node) -> fx.Node:
        if value not in self.summed:
            with self.gm.graph.inserting_before(before):
                self.summed[value] = self.gm.graph.call_function(
                    c.tp_grad_sum, (value, self.group, layer))
            self.summed[value].meta = {**value.meta, LAYER: layer}
        return self.summed[value]

    def _check(self, node: fx.Node, layer: str, dim: int) -> None:
        size = node.meta["val"].shape[dim]
        if size % (self.tp * self.cp):
            per_rank = f", {size / self.cp:g} per rank of cp={self.cp}," if self.cp > 1 else ""
            raise ShardingError(f"layer {layer}: sequence length {size} (dim {dim} of "
                                f"{node.name}){per_rank} is not divisible by tp={self.tp}")

    def _convert(self, node: fx.Node, fn, layer: str) -> fx.Node:
        """A new node (named after its collective) in place of a tp_copy / tp_all_reduce."""
        self._check(node, layer, self.dim)
        with self.gm.graph.inserting_before(node):
            new = self.gm.graph.call_function(fn, (node.args[0], self.group, layer, self.tp,
                                                   self.dim))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        self.gm.graph.erase_node(node)
        return new

    def _insert(self, fn, value: fx.Node, layer: str, dim: int, before=None) -> fx.Node:
        self._check(value, layer, dim)
        graph = self.gm.graph
        with graph.inserting_before(before) if before else graph.inserting_after(value):
            new = graph.call_function(fn, (value, self.group, layer or "", self.tp, dim))
        new.meta = {**value.meta, LAYER: layer}
        return new

    def _scatter(self, value: fx.Node, layer: str, dim: int | None = None, before=None):
        key = (value, dim)
        if key not in self.scattered:
            self.scattered[key] = self._insert(c.sp_scatter, value, layer,
                                               self.dim if dim is None else dim, before)
            self.sharded.add(self.scattered[key])
        return self.scattered[key]

    def _gather(self, value: fx.Node, user: fx.Node, layer: str | None) -> fx.Node:
        if value not in self.gathered:
            self.gathered[value] = self._insert(c.sp_gather, value, layer, self.dim, before=user)
        return self.gathered[value]


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return str(getattr(target, "__name__", target)).split(".")[0]


def _along_sequence(node: fx.Node, op: str, ndim: int, dim: int) -> bool:
    """Whether `node`, an op of _DIM_AT, is given the sequence dimension `dim` (of an input of
    `ndim` dimensions) as the dimension it works along."""
    if op not in _DIM_AT or node.op == "call_module":
        return False
    given = node.kwargs.get("dim", node.kwargs.get("dims", node.kwargs.get("dim0")))
    if given is None and len(node.args) > _DIM_AT[op]:
        given = node.args[_DIM_AT[op]]
    if op in ("transpose", "swapaxes", "movedim"):
        # moving the sequence is as refused as working along it (the walk keeps it at `dim`);
        # a merge with it (flatten) changes its length, which _per_token refuses
        given = list(node.args[1:3])
    dims = given if isinstance(given, (list, tuple)) else [given]
    return any(isinstance(d, int) and not isinstance(d, bool) and d % ndim == dim
               for d in dims)


def _attr(gm: nn.Module, target: str):
    prefix, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(prefix) if prefix else gm, name)


def _fuse_linears(gm: fx.GraphModule, gather: fx.Node) -> None:
    """sp_all_gather read only by linears -> one sp_gather_linear (saves the local slice only)."""
    graph, users = gm.graph, list(gather.users)
    params = [_linear_params(gm, user, gather) for user in users]
    if not users or any(p is None for p in params):
        return
    x, group, tag, parts, dim = gather.args
    first = min(users, key=_position(graph))
    for weight, bias in params:  # weights read through tp_grad_sum may come after `first`
        for node in (weight, bias):
            if isinstance(node, fx.Node):
                _hoist(node, first)
    with graph.inserting_before(first):
        weights, biases = [], []
        for user, (weight, bias) in zip(users, params):
            if isinstance(weight, str):  # a module's parameters: read them by name
                weight = graph.get_attr(weight)
                bias = graph.get_attr(bias) if bias else None
                for new in filter(None, (weight, bias)):
                    new.meta[LAYER] = user.meta.get(LAYER)
            weights.append(weight)
            biases.append(bias)
        fused = graph.call_function(c.sp_gather_linear, (x, tuple(weights), tuple(biases), group,
                                                          tag, parts, dim))
        fused.meta = {LAYER: gather.meta.get(LAYER),
                      "val": tuple(u.meta.get("val") for u in users)}
        for i, user in enumerate(users):
            out = graph.call_function(operator.getitem, (fused, i))
            out.meta = dict(user.meta)
            user.replace_all_uses_with(out)
    for user in users:
        graph.erase_node(user)
    graph.erase_node(gather)


def _hoist(node: fx.Node, before: fx.Node) -> None:
    """Move node (and what it reads: parameters only) in front of `before` if it comes later."""
    position = _position(node.graph)
    if position(node) > position(before):
        for arg in node.all_input_nodes:
            _hoist(arg, before)
        before.prepend(node)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _linear_params(gm, node: fx.Node, gather: fx.Node):
    """(weight, bias) of a linear reading `gather` as its input: parameter names for a module,
    nodes for F.linear; None for anything else."""
    if node.args[:1] != (gather,) or gather in node.args[1:]:
        return None
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        plain = type(module).forward is nn.Linear.forward
        if isinstance(module, nn.Linear) and plain and len(node.args) == 1 and not node.kwargs:
            return f"{node.target}.weight", f"{node.target}.bias" if module.bias is not None \
                else None
        return None
    if node.op == "call_function" and node.target in _LINEAR:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[1], bias
    return None
