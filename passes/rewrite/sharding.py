"""What the rewrite passes share: how parameters are cut (ShardSpec), the forms a linear takes in a
graph (LinearSite), the layer tag every node carries, and local shapes after a rewrite.

Linears are recognised in the forms symbolic_trace and torch.export produce: nn.Linear modules,
F.linear / aten.linear, addmm / aten.addmm (GPT-2's Conv1D, weight [in, out]) and mm / matmul by a
weight parameter read by get_attr. Weights that are graph inputs (a lifted export graph) are made
parameters first (`lift_params`) when their values are given.

Every node a rewrite inserts carries its layer in node.meta["fxpar_layer"] (`call_after` does it),
so later rewrites and the pipeline split place it. `localize_shapes` propagates fake shapes after
rewriting, rewriting literal sizes of views and expands that still name a full (unsharded) size
- the concrete shapes of export graphs, or GPT-2's `x.size()[:-1] + (nf,)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes.capture.trace import module_path
from passes.rewrite.size_reads import shapes_clash, sp_size_read
from passes.rewrite.weight_pieces import WeightPiece, linear_pieces, param_path
from runtime.attention import sinks  # noqa: F401 - registers torch.ops.fxpar.sink_attention
from runtime.comm import collectives as c
from runtime.training import rng
from runtime.programs.shards import ShardSpec, shard_specs  # noqa: F401 - re-exported for the passes

aten = torch.ops.aten
LAYER = "fxpar_layer"
# node.meta key of a view of a fused projection as (parts, heads, ...): its heads are cut
PARTS = "fxpar_parts"


class ShardingError(ValueError):
    """A split that does not divide; names the layer, the dimension and the divisor."""


def shard_param(full: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    """A new parameter holding this rank's shard; the spec travels with it (`shard_specs`)."""
    param = nn.Parameter(spec.take(full.detach()), full.requires_grad)
    param.fxpar_shard = spec
    return param


def shard_of(full: torch.Tensor, spec: ShardSpec, name: str, layer: str) -> nn.Parameter:
    """This rank's shard of a parameter, cut once: a weight two layers share (a head that reads
    the embedding's weight) is cut by the first and kept by the second, which must cut alike."""
    done = getattr(full, "fxpar_shard", None)
    if done is None:
        return shard_param(full, spec)
    if done != spec:
        raise ShardingError(f"layer {layer}: {name} is shared with another layer that shards it "
                            f"as {done}, but this one needs {spec}; give both the same strategy")
    return full


def replace_module(gm: nn.Module, target: str, make, spec: ShardSpec, layer: str) -> None:
    """The module at `target` replaced by make() (its shard by `spec`) once: a module applied at
    several places (a list holding one block several times) is cut by the first and kept by the
    others, which must cut it alike (see shard_of)."""
    done = getattr(getattr(gm.get_submodule(target), "weight", None), "fxpar_shard", None)
    if done is None:
        gm.add_submodule(target, make())
    elif done != spec:
        raise ShardingError(f"layer {layer}: {target} is applied at several places that shard "
                            f"it differently ({done} and {spec}); give them the same strategy")


def full_size(param: torch.Tensor, dim: int) -> int:
    """The unsharded size of dim: a parameter another layer sharing it has cut already (see
    shard_of) reports the size the model has, not its shard's."""
    spec = getattr(param, "fxpar_shard", None)
    if spec is not None and spec.dim == dim % param.dim():
        return param.shape[dim] * spec.parts - spec.pad
    return param.shape[dim]


def _owner(gm: nn.Module, path: str) -> tuple[nn.Module, str]:
    prefix, _, name = path.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), name


def get_param(gm: nn.Module, path: str) -> torch.Tensor:
    owner, name = _owner(gm, path)
    return getattr(owner, name)


def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it is computed from."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def replace_param(gm: nn.Module, path: str, value: nn.Parameter) -> None:
    owner, name = _owner(gm, path)
    setattr(owner, name, value)


# ---------------------------------------------------------------- layers and inserted nodes


def tag_layers(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]]) -> None:
    """Record each listed node's layer in its meta (inserted nodes are tagged when inserted)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for layer, names in layers.items():
        for name in names:
            if name in nodes:
                nodes[name].meta.setdefault(LAYER, layer)


def nodes_by_layer(gm: fx.GraphModule, chosen) -> dict[str, list[fx.Node]]:
    result: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.meta.get(LAYER) in chosen:
            result.setdefault(node.meta[LAYER], []).append(node)
    return result


def call_after(gm, anchor: fx.Node, fn, extra: tuple, layer: str, value: fx.Node | None = None,
               replace: bool = True) -> fx.Node:
    """Insert fn(value, *extra) after anchor (value defaults to anchor), tagged with `layer`; with
    `replace`, every other use of value reads the new node instead."""
    value = anchor if value is None else value
    with gm.graph.inserting_after(anchor):
        new = gm.graph.call_function(fn, (value, *extra))
    if replace:
        value.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    new.meta = {**value.meta, LAYER: layer}
    return new


# ---------------------------------------------------------------- linear forms

_LINEAR = {F.linear, aten.linear.default}
_ADDMM = {torch.addmm, aten.addmm.default}
_MM = {torch.mm, torch.matmul, operator.matmul, aten.mm.default, aten.matmul.default}
# rng's is the same attention, its dropout drawn from the tensor-parallel stream (runtime.training.rng).
SDPA = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default,
        rng.tp_scaled_dot_product_attention}


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA


# GPT-OSS's attention with sinks as one op (runtime.attention.sinks): q, k, v [b, heads, s, d]
SINK_ATTENTION = {torch.ops.fxpar.sink_attention.default}


def is_sink_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SINK_ATTENTION


def is_attention(node: fx.Node) -> bool:
    """A fused attention call: tokens mix inside it, heads do not."""
    return is_sdpa(node) or is_sink_attention(node)


@dataclass(frozen=True)
class LinearSite:
    """A linear in one of its graph forms: y = x W (+ b), W [out, in] (out_dim 0) or [in, out]."""

    node: fx.Node
    x: fx.Node
    module: nn.Linear | None
    weight: str                 # parameter path
    bias: str | None
    out_dim: int
    piece: WeightPiece | None = None   # the weight is this piece of the parameter

    @property
    def name(self) -> str:
        return str(self.node.target) if self.module is not None else self.weight

    def features(self, gm, dim: int) -> int:
        if self.piece is not None and dim == self.out_dim:
            return self.piece.sizes[self.piece.index]
        return full_size(get_param(gm, self.weight), dim)

    def drop_bias(self) -> None:
        """Compute x W only (the row-parallel bias is added after the reduction)."""
        node = self.node
        if node.target in _ADDMM:
            old = node.args[0]
            node.target = aten.mm.default if node.target is aten.addmm.default else torch.mm
            node.args = (self.x, node.args[2])
        else:
            old = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            node.args = node.args[:2]
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        if isinstance(old, fx.Node) and not old.users:
            node.graph.erase_node(old)


def linear_weight(node: fx.Node) -> fx.Node | None:
    """The weight argument of an F.linear / aten.linear call, whatever it is computed from."""
    if node.op == "call_function" and node.target in _LINEAR and len(node.args) > 1:
        return node.args[1]
    return None


def linear_site(gm: fx.GraphModule, node: fx.Node) -> LinearSite | None:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, nn.Linear):
            bias = f"{node.target}.bias" if module.bias is not None else None
            return LinearSite(node, node.args[0], module, f"{node.target}.weight", bias, 0)
        return None
    if node.op != "call_function" or node.kwargs.get("alpha", 1) != 1:
        return None
    args = node.args
    if node.target in _LINEAR and len(args) >= 2:
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        form = (args[0], args[1], bias, 0)
    elif node.target in _ADDMM and len(args) == 3 and node.kwargs.get("beta", 1) == 1:
        form = (args[1], args[2], args[0], 1)
    elif node.target in _MM and len(args) == 2:
        form = (args[0], args[1], None, 1)
    else:
        return None
    x, weight, bias, out_dim = form
    weight_path = param_path(gm, weight)
    if weight_path is None:   # a piece of a parameter cut in the graph (weight_pieces)
        pieces = linear_pieces(gm, weight, bias) if out_dim == 0 else None
        return None if pieces is None else LinearSite(node, x, None, *pieces[:2], 0, pieces[2])
    if get_param(gm, weight_path).dim() != 2:
        return None
    bias_path = param_path(gm, bias)
    if bias is not None and bias_path is None:
        return None
    return LinearSite(node, x, None, weight_path, bias_path, out_dim)


def lift_params(gm: fx.GraphModule, params: Mapping[str, torch.Tensor]) -> None:
    """Placeholders named in `params` become parameters of gm read by get_attr nodes."""
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and node.name in params:
            name = f"lifted_{node.name}"
            gm.register_parameter(name, nn.Parameter(params[node.name].detach().clone()))
            with gm.graph.inserting_before(node):
                attr = gm.graph.get_attr(name)
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            gm.graph.erase_node(node)


# ---------------------------------------------------------------- local shapes

_VIEWS = {"view", "reshape", torch.reshape, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default}
_EXPANDS = {"expand", aten.expand.default}
_RESHAPES = _VIEWS | {"flatten", torch.flatten, aten.flatten.using_ints}
_UNFLATTENS = {"unflatten", torch.unflatten, aten.unflatten.int}


def localize_shapes(gm: fx.GraphModule, inputs: tuple | None = None) -> None:
    """Propagate fake shapes through the rewritten graph from `inputs` (default: the placeholders'
    recorded values; context parallelism passes its shorter sequences), rewriting the literal
    sizes of views and expands that still name a full (unsharded) size."""
    full = {n: n.meta.get("val") for n in gm.graph.nodes}
    device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    if inputs is None:
        inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [torch.zeros(v.shape, dtype=v.dtype, device=device) if isinstance(v, torch.Tensor)
              else v for v in inputs]
    with _quiet_fake_tensor_log():
        _Localize(gm, full).propagate(*inputs)
    gm.recompile()


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """A node that does not run on the sharded shapes is a ShardingError naming it (a probe of a
    split that cannot work expects some); torch's fake-tensor mode would also log each such
    failure at ERROR, with a traceback, on the user's terminal."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = before


class _Localize(FakeTensorProp):
    def __init__(self, gm, full):
        super().__init__(gm, FakeTensorMode(allow_non_fake_inputs=True))
        self.extra_traceback = False  # else torch appends the node, a traceback, tlparse's URL
        self.full = full
        self.sp = any(n.target in _SP_OPS for n in gm.graph.nodes)  # sequence-parallel graph
        first = next((v for n, v in full.items() if n.op == "placeholder"
                      and isinstance(v, torch.Tensor) and v.dim()), None)
        self.batch = int(first.shape[0]) if first is not None else 1

    def run_node(self, n: fx.Node):
        # (by op: a placeholder may be named like one, as OPT's "expand" input is)
        reshapes = n.op in ("call_function", "call_method") and (
            n.target in _VIEWS or n.target in _EXPANDS or n.target in _UNFLATTENS)
        if reshapes:
            self._fix_unflatten(n) if n.target in _UNFLATTENS else self._fix_sizes(n)
        try:
            result = super().run_node(n)
        except ShardingError:
            raise
        except Exception as err:  # noqa: BLE001 - re-raised naming the node and its layer
            why = (self._asks_full(n) if n.target in _VIEWS else None) or \
                (sp_size_read(n, self.env, self.full, LAYER) if self.sp else None) or \
                shapes_clash(n, self.env, self.full) + (
                    "; under sequence parallelism a size read from a value split along the "
                    "sequence is the rank's share: read it from a value every rank holds "
                    "whole, or plan the layer with strategy=tp" if self.sp else "")
            raise ShardingError(f"layer {n.meta.get(LAYER)}: node {n.name} ({_target_name(n)})"
                                f"{_in_module(n)} does not run on the sharded shapes: "
                                f"{why}") from err
        if reshapes and n.target not in _EXPANDS:
            self._check_cut_kept(n, result)
        return result

    def _cuts(self, n: fx.Node):
        """(full input, local input, full output) shapes of a reshape whose input is cut."""
        source = n.args[0]
        local, full_in, full_out = self.env.get(source), self.full.get(source), self.full.get(n)
        if not all(isinstance(t, torch.Tensor) for t in (local, full_in, full_out)):
            return None
        return tuple(full_in.shape), tuple(local.shape), tuple(full_out.shape)

    def _fix_sizes(self, n: fx.Node) -> None:
        shapes = self._cuts(n)
        if shapes is None:
            return
        source, rest = n.args[0], n.args[1:]
        computed = len(rest) == 1 and isinstance(rest[0], fx.Node)
        given = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if computed:
            # Computed sizes (GPT-2's Conv1D: `x.size()[:-1] + (nf,)`) are read at run time,
            # hence local, except their constant tail.
            sizes, tail = self.env.get(rest[0]), _constant_tail(rest[0])
            literal = range(len(sizes) - len(tail), len(sizes)) if isinstance(
                sizes, (list, tuple)) else range(0)
        else:
            # Sizes given one by one: those read from tensors at run time (`x.shape[0]`) are
            # local already, the literal ones (a head count held by the module) are full.
            sizes = [self.env[s] if isinstance(s, fx.Node) else s for s in given]
            literal = [i for i, s in enumerate(given) if isinstance(s, int)]
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes):
            return
        new = _local_sizes(n, *shapes, list(sizes), n.target in _EXPANDS, literal, self.batch)
        if not computed and n.target in _VIEWS:
            given = self._sizes_read_elsewhere(n, given, new, shapes)
        if new == list(sizes):
            return
        if computed:
            rest[0].update_arg(1, tuple(new[literal.start:]))
            self.env[rest[0]] = tuple(new)
        else:
            new = [new[i] if i in literal else s for i, s in enumerate(given)]
            n.args = (source, type(given)(new)) if len(rest) == 1 else (source, *new)

    def _sizes_read_elsewhere(self, n: fx.Node, given, sizes: list, shapes) -> list:
        """Sizes read at run time from another value than the one reshaped, where the cut output
        has another size: timm's `reshape(B, N, C)` of the heads merged back, C read from the
        block's input every rank holds whole (the full width, where the cut holds 1/tp of it);
        under sequence parallelism nanoGPT's `B, T, C = x.size()`, T read from the rank's
        sequence shard, where the reshaped value holds the whole sequence. Such a size becomes
        the cut output's (a literal); the others stay as read."""
        expected = _cut_output(*shapes, self.batch, n.meta.get(PARTS, 1))
        _, _, full_out = shapes
        if expected is None or len(given) != len(full_out):
            return given
        given = list(given)
        for i, size in enumerate(given):
            if not isinstance(size, fx.Node) or sizes[i] == expected[i]:
                continue
            whole_width = sizes[i] == full_out[i]
            from_shard = self.sp and type(self.full.get(size)) is int and \
                self.full[size] == expected[i]
            if whole_width or from_shard:
                given[i] = sizes[i] = expected[i]
        return given

    def _fix_unflatten(self, n: fx.Node) -> None:
        """unflatten(x, dim, sizes) of a cut dimension: its outermost literal size (the heads of
        `(heads, -1)` or `(heads, head_dim)`) is the one the cut divides."""
        shapes = self._cuts(n)
        dim, sizes = (_arg_or(n, 1, "dim"), _arg_or(n, 2, "sizes"))
        if shapes is None or not isinstance(dim, int) or not isinstance(sizes, (list, tuple)):
            return
        full_in, local_in, _ = shapes
        dim %= len(full_in)
        if full_in[dim] == local_in[dim] or full_in[dim] % local_in[dim] or \
                not all(isinstance(s, int) for s in sizes) or sizes[0] == -1:
            return
        factor = full_in[dim] // local_in[dim]
        # a fused projection's parts first ((3, width) of nn.MultiheadAttention's packed qkv):
        # every rank holds each part, the cut divides what follows them
        at = 1 if n.meta.get(PARTS, 1) > 1 and len(sizes) > 1 else 0
        if sizes[at] % factor:
            raise ShardingError(f"layer {n.meta.get(LAYER)}: {n.name} unflattens dim {dim} into "
                                f"{tuple(sizes)}, whose {sizes[at]} does not divide by the cut "
                                f"{factor}")
        new = (*sizes[:at], sizes[at] // factor, *sizes[at + 1:])
        if len(n.args) > 2:
            n.args = (*n.args[:2], type(sizes)(new), *n.args[3:])
        else:
            n.kwargs = {**n.kwargs, "sizes": new}

    def _check_cut_kept(self, n: fx.Node, result) -> None:
        """A reshape of a cut value must give the full output cut the same way: heads fewer per
        rank, each as wide as in one process. A size the model fixed that no rewrite could
        change (a head width computed from a constant head count) would otherwise reshape each
        rank's features into other heads: another computation, without an error."""
        shapes = self._cuts(n)
        if shapes is None or not isinstance(result, torch.Tensor):
            return
        expected = _cut_output(*shapes, self.batch, n.meta.get(PARTS, 1))
        if expected is not None and tuple(result.shape) != expected:
            full_in, local_in, full_out = shapes
            asked = self._asked(n) if n.target in _VIEWS else None
            raise ShardingError(
                f"layer {n.meta.get(LAYER)}: {n.name} ({_target_name(n)}){_in_module(n)} "
                f"reshapes the rank's part {local_in} of {full_in} into {tuple(result.shape)}, "
                f"not {expected} (its full {full_out} cut alike): "
                f"{self._advice(asked, expected, full_out)}")

    def _asks_full(self, n: fx.Node) -> str | None:
        """Why a view or reshape of a cut value failed, with the size to change (None where the
        sizes or the cut cannot be read: torch's own message then)."""
        shapes, asked = self._cuts(n), self._asked(n)
        expected = _cut_output(*shapes, self.batch, n.meta.get(PARTS, 1)) if shapes else None
        if expected is None or asked is None:
            return None
        full_in, local_in, full_out = shapes
        return (f"it asks for {tuple(asked)} of the rank's part {local_in} of {full_in}, cut "
                f"to {expected}: {self._advice(asked, expected, full_out)}")

    def _asked(self, n: fx.Node) -> list[int] | None:
        """The sizes a view or reshape asks for, as it runs here (-1 kept)."""
        rest = n.args[1:]
        if len(rest) == 1 and isinstance(rest[0], (list, tuple, fx.Node)):
            rest = rest[0]
        sizes = self.env.get(rest) if isinstance(rest, fx.Node) else \
            [self.env.get(s) if isinstance(s, fx.Node) else s for s in rest]
        if isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes):
            return list(sizes)
        return None

    def _advice(self, asked: list[int] | None, expected: tuple, full_out: tuple) -> str:
        """Which size of a reshape does not follow the cut, and what to write instead."""
        wrong = [d for d, (a, e) in enumerate(zip(asked or (), expected)) if a not in (-1, e)]
        if not wrong or len(asked) != len(expected):
            return ("a size fixed in the model does not follow the cut; take the sizes from the "
                    "shape of the tensor reshaped (or write the cut dimension as -1)")
        d = wrong[0]
        why = f"its size {asked[d]} at dim {d} does not follow the cut"
        if self.sp and asked[d] < expected[d]:  # read from a sequence shard's shape
            why += (" (under sequence parallelism a size read from a block input's shape is "
                    "the rank's 1/tp of the sequence, and this tensor holds all of it)")
        free = [k for k, a in enumerate(asked) if a == -1]
        if not free:
            return f"{why}; write dim {d} as -1"
        if expected[free[0]] == full_out[free[0]]:  # the -1 stands for a size the cut keeps
            return (f"{why}; write dim {d} as -1 and dim {free[0]} as its size, "
                    f"{expected[free[0]]} (the same on every rank)")
        return (f"{why}; take the sizes from the shape of the tensor reshaped (or flatten it), "
                f"not from another tensor's")


def _arg_or(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _target_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _in_module(node: fx.Node) -> str:
    """" in module 'blocks.0.attn'" for a message, "" where the capture recorded none."""
    path = module_path(node)
    return f" in module '{path}'" if path else ""


# the collectives passes.rewrite.sequence_parallel inserts: their graph's block inputs are shards
_SP_OPS = {c.sp_all_gather, c.sp_reduce_scatter, c.sp_scatter, c.sp_gather, c.sp_gather_linear}


def _cut_output(full_in, local_in, full_out, batch: int, parts: int = 1) -> tuple | None:
    """The local output of a reshape whose input dimensions are cut evenly: each cut dimension
    divides the output dimension holding it (None where a cut is uneven or not found)."""
    out = list(full_out)
    for d, (full, local) in enumerate(zip(full_in, local_in)):
        if full == local:
            continue
        j = _output_dim(full_in, full_out, d, False, batch, parts)
        if local == 0 or full % local or j is None or out[j] % (full // local):
            return None
        out[j] //= full // local
    return tuple(out)


def _constant_tail(sizes: fx.Node) -> tuple:
    """The constant part of sizes built as `x.size()[...] + (constants,)`; () otherwise."""
    if sizes.target is operator.add and len(sizes.args) == 2 and isinstance(sizes.args[1], tuple):
        return sizes.args[1]
    return ()


def _local_sizes(n, full_in, local_in, full_out, sizes, expand: bool, literal: range,
                 batch: int = 1) -> list[int]:
    """`sizes` with each output dimension that holds a cut input dimension divided by its cut
    (tensor parallel cuts heads or features, context parallel the sequence, both at once); only
    the `literal` indices of sizes are full-size constants, the others are local already."""
    for d in range(len(full_in)):
        if full_in[d] == local_in[d] or full_in[d] % local_in[d]:
            continue
        factor = full_in[d] // local_in[d]
        j = _output_dim(full_in, full_out, d, expand, batch, n.meta.get(PARTS, 1))
        if j is None or j not in literal or sizes[j] == -1:
            continue
        if sizes[j] % factor:
            raise ShardingError(f"layer {n.meta.get(LAYER)}: size {sizes[j]} (dim {j} of "
                                f"{n.name}) is not divisible by {factor}")
        sizes[j] //= factor
    return sizes


def _output_dim(full_in, full_out, d: int, expand: bool, batch: int = 1,
                parts: int = 1) -> int | None:
    """The output dimension holding input dimension d: the same one counted from the end for an
    expand, the one holding the first element of d for a view - but for the batch, which no
    pass cuts: a flattened [batch * seq] (GPT-2's Conv1D) viewed back as [batch, seq] is cut
    in its sequence; and for a fused projection's features viewed as (parts, heads, ...)
    (PARTS), which are cut in their heads."""
    if expand:
        return d + len(full_out) - len(full_in)
    before, prefix = math.prod(full_in[:d]), 1
    for i, size in enumerate(full_out):
        if size > 1 and prefix <= before < prefix * size:
            if i == 0 and batch > 1 and size == batch and full_in[d] > size:
                return next((k for k in range(1, len(full_out)) if full_out[k] > 1), None)
            if parts > 1 and size == parts and d == len(full_in) - 1 and i + 1 < len(full_out):
                return i + 1
            return i
        prefix *= size
    return None


def before_views(x: fx.Node, reader: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(value, its reader): x, or what x re-views when it is used only for this linear - so a
    region starts on [batch, seq, hidden] rather than Conv1D's flattened [batch * seq, hidden]."""
    while x.target in _RESHAPES and len(x.users) == 1 and x.args[0].meta.get("val") is not None:
        x, reader = x.args[0], x
    return x, reader


def after_views(node: fx.Node) -> fx.Node:
    """The last of the views that only re-shape node's output (Conv1D's view back to 3-d)."""
    while len(node.users) == 1 and next(iter(node.users)).target in _RESHAPES:
        node = next(iter(node.users))
    return node


def shard_outputs(gm: fx.GraphModule, site: LinearSite, spec: ShardSpec, module_cls,
                  layer: str) -> None:
    """Cut a linear's output features by `spec`: its module replaced by module_cls(module,
    spec), or its weight replaced by its shard, and its bias by the same cut along dim 0."""
    if site.module is not None:
        replace_module(gm, site.node.target, lambda: module_cls(site.module, spec), spec, layer)
        return
    replace_param(gm, site.weight, shard_of(get_param(gm, site.weight), spec, site.weight,
                                            layer))
    if site.bias is not None:
        bias = dataclasses.replace(spec, dim=0)
        replace_param(gm, site.bias, shard_of(get_param(gm, site.bias), bias, site.bias, layer))
