"""Is a tensor-parallel rewrite of a layer exact? A dataflow check on the captured graph.

The rewrite (passes.rewrite.tensor_parallel) makes a linear column-parallel when its input is whole and
row-parallel when its input is sharded; every other op with a sharded input is assumed to work
shard by shard. That holds only where the op does not look across the sharded dimension. A
mixture-of-experts router is the case in point: its linear is made column-parallel, so each rank
holds the scores of some experts, and a softmax or top-k over them is silently wrong.

`check_layer` follows the sharded dimension from each column-parallel linear (its output features)
through the layer, on the full shapes of the capture, and proves that every sharded value reaches a
row-parallel linear (which contracts over the sharded dimension, then all-reduces) through ops that
work on the other dimensions only: elementwise ops (other operands broadcast along the sharded
dimension), views that keep whole heads, transposes, reductions, norms, softmax and slicing over
other dimensions, attention with the sharded dimension as its heads (SDPA, and fxpar's sink
attention, whose sinks are then cut like the query heads: `Findings.cut_params`), matmuls whose
contraction is another dimension, and the split of a fused projection the rewrite knows how to
cut. Anything else that reads a sharded value, and a sharded value that leaves the layer, is a
ShardingError naming the node and what it does; the planner then leaves the layer's
tensor-parallel strategies out of the search, with that reason.

Two ops that do look across the sharded dimension are made exact by the rewrite, when the value's
parts on the tp ranks are equal contiguous blocks of it (a column-parallel output, not a fused
one before its split, nor kv heads each rank selects from a whole projection): a sum or mean over
the sharded dimension (the statistics of an RMSNorm over all heads, OLMo-2's q/k norms), whose
partial results are then summed over the group (`Findings.reduced`), and an elementwise op with
a whole trained parameter of the sharded dimension's full size (that norm's weight), which is
then sharded like the value (`Findings.cut_params`).

A linear of whole input whose output features tp does not divide cannot be column-parallel: it
stays whole on every rank (`Findings.whole`), its output whole like any replicated value.

A view may merge the sharded dimension, innermost, with dimensions before it (BLOOM's eager
attention runs on [batch x heads, seq, head_dim]); each rank then holds its heads of every batch
row, which batched matmuls, elementwise ops and views that split the dimensions again keep, and
which no linear may contract. A whole value computed from no input and no trained parameter
(passes.capture.trace marks them: BLOOM's ALiBi bias, built before the blocks per batch row and head)
that meets such a value along the sharded dimension is read per rank, its heads' part only
(`Findings.sliced`). So is a whole value that carries a gradient (T5's relative position bias,
[1, heads, q, k] from a trained embedding in the first block, reused by every later one; an
attention mask per head): it is the same on every rank, so each rank's part is exact forward, and
read through tp_copy (`Findings.copied`) its gradient - on each rank only its heads' part - is
summed over the group on the way back, whole again for what computed it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from passes.rewrite.fused_parts import fused_cut
from passes.rewrite.sharding import ShardingError, linear_site, linear_weight
from passes.rewrite.tp_convs import CONV_FUNCTIONS, CONV_MODULES, ConvRules
from passes.rewrite.tp_gather import GatherNeeded, modulation_source
from passes.rewrite.tp_grad_paths import ShareFixes, share_fixes
from passes.rewrite.tp_views import ViewRules, _arg, _val, op_name
from passes.rewrite.value_sources import carries_grad, is_constant, trained_param

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "floordiv", "neg", "pow", "rsqrt", "sqrt", "exp",
    "log", "abs", "tanh", "sigmoid", "relu", "gelu", "silu", "erf", "clamp", "where", "dropout",
    "masked_fill", "to", "type", "type_as", "float", "half", "bfloat16", "contiguous", "clone",
    "detach", "_to_copy", "alias", "native_dropout", "square", "reciprocal", "softplus", "sin",
    "cos", "fill", "zeros_like", "ones_like", "leaky_relu", "elu", "mish", "hardtanh", "sign",
    # comparisons and more pointwise maths (xIELU's branches, clipping by a threshold)
    "gt", "lt", "ge", "le", "eq", "ne", "logical_and", "logical_or", "logical_not", "expm1",
    "log1p", "floor", "ceil", "round", "trunc", "maximum", "minimum", "relu6", "hardsigmoid",
    "hardswish", "selu", "celu", "logsigmoid", "softsign", "addcmul", "addcdiv", "lerp",
}
_ELEMENTWISE_MODULES = (nn.Dropout, nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity,
                        nn.Mish, nn.LeakyReLU, nn.ELU, nn.Softplus, nn.ReLU6, nn.Hardswish,
                        nn.Hardsigmoid, nn.SELU, nn.CELU, nn.LogSigmoid, nn.Softsign, nn.Hardtanh)
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "norm",
               "logsumexp", "argmax", "argmin", "any", "all", "cumsum", "cumprod", "softmax",
               "log_softmax", "_softmax", "_log_softmax", "topk", "sort", "argsort", "median",
               "var_mean", "kthvalue", "linalg_vector_norm", "count_nonzero"}
_NORMS = {"layer_norm", "rms_norm", "native_layer_norm", "group_norm", "normalize"}
_SLICES = {"narrow", "slice", "select", "index_select", "gather", "take_along_dim"}
_P_FIRST = {"norm", "linalg_vector_norm"}  # (x, p, dim)
_IGNORED = {"size", "dim", "sym_size", "_assert_tensor_metadata", "getattr"}
_LINEAR_REDUCTIONS = {"sum", "mean"}  # exact as the group's sum of per-rank partial results


@dataclass
class Findings:
    """What the rewrite must add for the layer to be exact (see the module docstring)."""

    reduced: dict[fx.Node, str] = field(default_factory=dict)  # sum / mean over the sharded dim
    cut_params: dict[str, int] = field(default_factory=dict)   # parameter path -> dim to shard
    # (node, whole constant operand) -> (its dim along the sharded one, heads in that dim):
    # each rank reads its heads' part
    sliced: dict[tuple[fx.Node, fx.Node], tuple[int, int]] = field(default_factory=dict)
    # column-parallel linears whose output is all-gathered whole (passes.rewrite.tp_gather)
    gathered: set[fx.Node] = field(default_factory=set)
    # those of `sliced` that carry a gradient: read through tp_copy before their part is taken
    copied: set[tuple[fx.Node, fx.Node]] = field(default_factory=set)
    # node -> its whole operands with a gradient, broadcast along the sharded dimension (a
    # router's gate, a scale computed from the block's input): read through tp_copy, since each
    # rank's part of the output gives them only that part's share of their gradient
    broadcast: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    # reads to convert around values computed from the statistics of `reduced`, so that each
    # gets one kind of gradient share (passes.rewrite.tp_grad_paths)
    shares: ShareFixes = field(default_factory=ShareFixes)
    # a fused projection viewed as (parts, heads, head_dim) (timm's qkv.reshape(B, N, 3, H, d)):
    # linear -> parts, cut per part like a fused QKV; and the view -> parts
    parted: dict[fx.Node, int] = field(default_factory=dict)
    parted_views: dict[fx.Node, int] = field(default_factory=dict)
    # depthwise convolutions of sharded channels: their group count set to the rank's channels
    depthwise: set[fx.Node] = field(default_factory=set)
    # linears of whole input whose output features do not divide by tp (Qwen2-MoE's
    # Linear(h, 1) gating its shared expert): whole on every rank, read outside tp_copy, so
    # their gradients are each rank's same whole ones
    whole: set[fx.Node] = field(default_factory=set)


class _Flow(ViewRules, ConvRules):
    """The walk over one layer: sharded dimension of each value (full-shape index)."""

    def __init__(self, gm, layer: str, nodes: list[fx.Node], tp: int, whole_heads: set,
                 gathered: set = frozenset()):
        self.gm, self.layer, self.tp, self.gathered = gm, layer, tp, gathered
        self.nodes = nodes
        self.inside = set(nodes)
        self.dim: dict[fx.Node, int] = {}
        self.fused_splits: set[fx.Node] = set()
        # Outputs of k/v projections kept whole, of which each rank selects whole heads.
        self.whole_heads = set(whole_heads)
        # Values whose part on tp rank r is block r of tp equal contiguous blocks of the sharded
        # dimension (so the parts of all ranks are disjoint and in order).
        self.blocks: set[fx.Node] = set()
        # Sizes of the dimensions merged in front of the sharded one, where a view merged them.
        self.outer: dict[fx.Node, int] = {}
        self.found = Findings()

    def fail(self, node: fx.Node, why: str) -> None:
        raise ShardingError(f"layer {self.layer}: not tensor-parallel: {node.name} "
                            f"({op_name(self.gm, node)}) {why}{self._weight_parts()}")

    def _weight_parts(self) -> str:
        """Why a refusal may follow from a linear the walk does not see: one whose weight is
        computed in the graph from a parameter in a form other than the pieces of a split by
        rows (passes.rewrite.weight_pieces), which stays whole, so the linears after it are
        taken as column-parallel."""
        for node in self.nodes:
            weight = linear_weight(node)
            if linear_site(self.gm, node) is not None:
                continue
            steps = 0
            while isinstance(weight, fx.Node) and weight.op == "call_function" and steps < 4:
                weight, steps = weight.args[0] if weight.args else None, steps + 1
            if steps and isinstance(weight, fx.Node) and weight.op == "get_attr":
                return (f" (behind it: {node.name} multiplies by a weight computed from "
                        f"{weight.target} in the graph; fxpar cuts whole weights, and the "
                        f"pieces of one split by rows into a list of sizes, as "
                        f"nn.MultiheadAttention's cross-attention splits its in-projection; "
                        f"apply the parameter, or such pieces of it, to run this block "
                        f"tensor-parallel)")
        return ""

    def run(self) -> Findings:
        for node in self.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            site = linear_site(self.gm, node)
            if site is not None:
                self._linear(node, site)
            elif any(a in self.dim for a in node.all_input_nodes):
                self._other(node)
        for node, _ in self.dim.items():
            outside = [u for u in node.users if u.op == "output" or u not in self.inside]
            if outside:
                self.fail(node, f"is sharded over tp={self.tp} and leaves the layer (read by "
                                f"{outside[0].name}) without reaching a row-parallel linear")
        self.found.shares = share_fixes(self.gm, self.nodes, self.found.reduced, self.dim)
        for node, wholes in self.found.broadcast.items():  # those from statistics: share_fixes
            wholes[:] = [a for a in wholes if a not in self.found.shares.region]
        if self.found.shares.module is not None:
            self.fail(self.found.shares.module, "applies a module with parameters of its own to "
                      "the statistics of a norm over the sharded features, so each rank would "
                      "hold only its share of their gradient; apply it as functions of its "
                      "parameters, or before the norm")
        return self.found

    def _linear(self, node: fx.Node, site) -> None:
        x = site.x
        if x not in self.dim:  # column-parallel: output features sharded
            if node in self.gathered:  # ... and gathered whole again (passes.rewrite.tp_gather)
                return
            out = _val(node)
            if out is not None and out.shape[-1] % self.tp and node not in self.whole_heads:
                self.found.whole.add(node)  # its features do not split: whole, not sharded
                return
            if out is not None:
                self.dim[node] = out.dim() - 1
                cut = fused_cut(node)
                if cut:
                    self.fused_splits.add(cut.user)
                elif node not in self.whole_heads:
                    self.blocks.add(node)
            return
        if self.dim[x] != _val(x).dim() - 1:
            self.fail(node, f"contracts over its last dimension, but its input {x.name} is "
                            f"sharded on dimension {self.dim[x]}")
        if self.outer.get(x, 1) > 1:
            self.fail(node, f"contracts over features of {x.name} in which the sharded "
                            f"dimension is merged after others (not a block of the weight)")

    def _other(self, node: fx.Node) -> None:
        name = op_name(self.gm, node)
        src = next(a for a in node.all_input_nodes if a in self.dim)
        d, out = self.dim[src], _val(node)
        if name in _IGNORED:
            return
        if node.target is operator.getitem:
            return self._getitem(node, src, d)
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, _ELEMENTWISE_MODULES) or (module is None and name in _ELEMENTWISE):
            return self._elementwise(node, out)
        if name in ("max", "min") and isinstance(_arg(node, 1, "other"), fx.Node) and \
                _val(_arg(node, 1, "other")) is not None:  # torch.max(a, b): elementwise
            return self._elementwise(node, out)
        if module is not None and isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return self._check_norm(node, src, d, len(module.normalized_shape))
        if isinstance(module, CONV_MODULES) or (module is None and name in CONV_FUNCTIONS):
            return self._conv(node, src, d)
        rules = {**dict.fromkeys(_VIEWS, self._view), **dict.fromkeys(_REDUCTIONS, self._reduce),
                 **dict.fromkeys(_NORMS, self._norm), **dict.fromkeys(_SLICES, self._slice),
                 "transpose": self._transpose, "swapaxes": self._transpose, "t": self._transpose,
                 "permute": self._permute, "movedim": self._movedim, "expand": self._expand,
                 "repeat_interleave": self._keep, "chunk": self._split, "split": self._split,
                 "split_with_sizes": self._split, "unbind": self._unbind,
                 "cat": self._cat, "stack": self._stack,
                 "scaled_dot_product_attention": self._attention,
                 "sink_attention": self._sink_attention,
                 "matmul": self._matmul, "bmm": self._matmul, "mm": self._matmul,
                 "pad": self._pad, "constant_pad_nd": self._pad, "einsum": self._einsum,
                 "baddbmm": self._baddbmm, "view_as_complex": self._complex,
                 "view_as_real": self._complex}
        rule = rules.get(name)
        if rule is None:
            why = (f"reads a value sharded over tp={self.tp} (dimension {d} of {src.name}) and "
                   f"is not known to work shard by shard")
            self._gather_instead([src], split=True, why=(node, why))  # read whole (BLIP-2)
            self.fail(node, why)
        rule(node, src, d)
        if node in self.dim and node not in self.outer and self.outer.get(src, 1) > 1:
            self.outer[node] = self.outer[src]
        # ops on the other dimensions keep each rank's part a block of the sharded one
        if node in self.dim and rule != self._view and all(
                a in self.blocks for a in node.all_input_nodes if a in self.dim):
            self.blocks.add(node)

    # -- rules: each sets self.dim[node] or fails ---------------------------------------------
    def _elementwise(self, node: fx.Node, out) -> None:
        if out is None:
            return
        dims = set()
        for a in node.all_input_nodes:
            v = _val(a)
            if v is None:
                continue
            if a in self.dim:
                dims.add(self.dim[a] + out.dim() - v.dim())
        (d,) = dims if len(dims) == 1 else (None,)
        if d is None:
            self.fail(node, "combines values sharded on different dimensions")
        sharded = [a for a in node.all_input_nodes if a in self.dim]
        in_blocks = all(a in self.blocks for a in sharded)
        for a in node.all_input_nodes:
            v = _val(a)
            aligned = d - (out.dim() - v.dim()) if v is not None else -1
            if a not in self.dim and v is not None and 0 <= aligned and v.shape[aligned] > 1:
                if in_blocks and self._param_of_full_size(a, v, aligned, out.shape[d]) and \
                        all(self.outer.get(x, 1) == 1 for x in sharded):
                    self.found.cut_params[str(a.target)] = aligned
                    continue
                why = (f"combines a sharded value with {a.name}, which is whole along the "
                       f"sharded dimension")
                self._gather_instead(sharded, why=(node, why))  # a modulation's part
                if in_blocks and self._slices(node, a, v, aligned, out.shape[d], sharded):
                    continue
                self.fail(node, why)
            elif a not in self.dim and v is not None and carries_grad(self.gm, a):
                self.found.broadcast.setdefault(node, []).append(a)
        self.dim[node] = d
        if in_blocks:
            self.blocks.add(node)

    def _slices(self, node, a: fx.Node, v: torch.Tensor, dim: int, size: int, sharded) -> bool:
        """A whole value as long along `dim` as the sharded dimension it meets (an ALiBi bias
        built before the blocks, T5's position bias): each rank can take its part of it; one
        computed from no input and no trained parameter has no gradient to sum, any other is
        read through tp_copy, which sums each rank's part of its gradient."""
        outers = {self.outer.get(x, 1) for x in sharded}
        if v.shape[dim] != size or len(outers) != 1:
            return False
        heads = size // outers.pop()
        if heads % self.tp:
            self.fail(node, f"meets {a.name}, whole along {heads} heads, which tp={self.tp} "
                            f"does not divide")
        self.found.sliced[(node, a)] = (dim, heads)
        if not is_constant(self.gm, a):
            self.found.copied.add((node, a))
        return True

    def _param_of_full_size(self, a: fx.Node, v: torch.Tensor, dim: int, size: int) -> bool:
        """A trained parameter read as is, as long along `dim` as the sharded dimension: it can
        be cut like the value it meets (a norm's weight over all heads' features)."""
        if a.op != "get_attr" or v.shape[dim] != size:
            return False
        cut = self.found.cut_params.get(str(a.target), dim)
        return trained_param(self.gm, a) and cut == dim

    def _keep(self, node, src, d) -> None:
        self.dim[node] = d

    def _getitem(self, node, src, d) -> None:
        index = node.args[1]
        if _val(node) is None:
            return
        if _val(src) is None:  # a part of a chunk / split result
            self.dim[node] = d
            # each part of a fused projection is cut in blocks; so is each part of a split
            # along another dimension of a value cut in blocks (rotary's halves of head_dim)
            if src in self.fused_splits or src in self.blocks:
                self.blocks.add(node)
            if src in self.whole_heads:   # of a projection kept whole: heads selected per part
                self.whole_heads.add(node)
            return
        index = index if isinstance(index, tuple) else (index,)
        self.dim[node] = self._index_dim(node, index, d, _val(src).dim())
        if src in self.blocks:
            self.blocks.add(node)

    def _index_dim(self, node, index: tuple, d: int, ndim: int) -> int:
        """Output dimension of input dimension d under basic indexing (ints, slices, None, ...)."""
        out_dim, in_dim = 0, 0
        if Ellipsis in index:
            at = index.index(Ellipsis)
            fill = ndim - sum(1 for i in index if i is not None and i is not Ellipsis)
            index = index[:at] + (slice(None),) * fill + index[at + 1:]
        for item in index:
            if item is None:
                out_dim += 1
                continue
            if in_dim == d:
                if item != slice(None):
                    self.fail(node, "indexes the sharded dimension")
                return out_dim
            in_dim += 1
            out_dim += not isinstance(item, int)
        return out_dim + (d - in_dim)

    def _expand(self, node, src, d) -> None:
        self.dim[node] = d + _val(node).dim() - _val(src).dim()

    def _dims(self, node, ndim: int, index: int = 1) -> tuple[int, ...] | None:
        dim = _arg(node, index, "dim")
        if dim is None:
            return None
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return tuple(self._int(node, x) % ndim for x in dims)

    def _reduce(self, node, src, d) -> None:
        ndim = _val(src).dim()
        name = op_name(self.gm, node)
        dims = self._dims(node, ndim, 2 if name in _P_FIRST else 1)
        if dims is not None and d in dims and name in _LINEAR_REDUCTIONS:
            if src not in self.blocks:
                self.fail(node, f"sums over the sharded dimension {d} of {src.name}, whose parts "
                                f"on the tp={self.tp} ranks are not known to be disjoint blocks "
                                f"(kv heads each rank selects from a whole projection?)")
            self.found.reduced[node] = name  # whole once the rewrite sums it over the group
            return
        if dims is None or d in dims:
            why = (f"reduces or normalises over the sharded dimension {d} (tp={self.tp} ranks "
                   "would each see a part of it)")
            self._gather_instead([src], split=True, why=(node, why))  # a router's logits
            self.fail(node, why)
        out = _val(node) if _val(node) is not None else (node.meta.get("val") or [None])[0]
        keep = out is not None and out.dim() == ndim
        self.dim[node] = d if keep else d - sum(1 for x in dims if x < d)

    def _norm(self, node, src, d) -> None:
        if op_name(self.gm, node) == "normalize":
            return self._reduce(node, src, d)
        shape = _arg(node, 1, "normalized_shape")
        self._check_norm(node, src, d, len(shape) if isinstance(shape, (tuple, list)) else 1)

    def _check_norm(self, node, src, d, trailing: int) -> None:
        if d >= _val(src).dim() - trailing:
            self.fail(node, f"normalises over the sharded dimension {d} (tp={self.tp}), of "
                            f"which each rank holds a part; a norm written with means "
                            f"(x.pow(2).mean(-1, keepdim=True), as Hugging Face's RMSNorm "
                            f"classes are) has its statistics summed over the group")
        self.dim[node] = d

    def _slice(self, node, src, d) -> None:
        ndim = _val(src).dim()
        dim = _arg(node, 1, "dim", 0) % ndim
        if dim == d:
            self.fail(node, "slices or gathers along the sharded dimension")
        removes = op_name(self.gm, node) == "select"
        self.dim[node] = d - (removes and dim < d)

    def _split(self, node, src, d) -> None:
        dim = _arg(node, 2, "dim", 0) % _val(src).dim()
        if dim == d and node not in self.fused_splits and not self._of_whole(src):
            why = (f"splits the sharded dimension of {src.name} ({op_name(self.gm, src)}); a "
                   f"split is cut per rank only where it reads a linear's output itself (a "
                   f"fused projection): split before any view or other op, then reshape the "
                   f"parts")
            self._gather_instead([src], split=True, why=(node, why))
            self.fail(node, why)
        if self._of_whole(src):
            self.whole_heads.add(node)
        self.dim[node] = d

    def _gather_instead(self, sharded: list[fx.Node], split: bool = False,
                        why: tuple[fx.Node, str] | None = None) -> None:
        """Where a column-parallel output's parts are refused (`why`: the node and the
        refusal), gather the linear whole instead when the value is such a part
        (passes.rewrite.tp_gather): GatherNeeded reruns the check."""
        for value in sharded:
            linear = modulation_source(self.gm, value, op_name, split)
            if linear is not None and linear in self.dim and \
                    linear_site(self.gm, linear).x not in self.dim:
                node, text = why or (value, "")
                raise GatherNeeded(linear, f"{node.name} ({op_name(self.gm, node)}) {text}")

    def _of_whole(self, value: fx.Node) -> bool:
        """`value` is a projection kept whole (or views of it), whose parts each rank reads its
        heads of (passes.rewrite.tensor_parallel.FusedTake)."""
        while value not in self.whole_heads and len(value.all_input_nodes) == 1 and \
                op_name(self.gm, value) in ("unsqueeze", "view", "reshape"):
            value = value.all_input_nodes[0]
        return value in self.whole_heads

    def _cat(self, node, src, d) -> None:
        tensors = node.args[0]
        dim = _arg(node, 1, "dim", 0) % _val(src).dim()
        if dim == d or any(self.dim.get(t) != d for t in tensors):
            self.fail(node, "concatenates along the sharded dimension or with whole values")
        self.dim[node] = d

    def _stack(self, node, src, d) -> None:
        """Stacking values all sharded on d along a new dimension (interleaved rotary halves)."""
        tensors = node.args[0]
        new = _arg(node, 1, "dim", 0) % (_val(src).dim() + 1)
        if any(self.dim.get(t) != d for t in tensors):
            self.fail(node, "stacks sharded values with whole ones or ones sharded differently")
        self.dim[node] = d + (new <= d)

    def _heads(self, node) -> int:
        """The heads dimension of attention `node` (q, k, v its first arguments), which all
        three must be sharded on."""
        q, k, v = node.args[:3]
        heads = _val(q).dim() - 3
        # A single kv head read whole by every rank (multi-query, its projection kept whole).
        one_head = lambda t: t in self.whole_heads and _val(t).shape[heads] == 1  # noqa: E731
        if any(self.dim.get(t) != heads and not one_head(t) for t in (q, k, v)):
            self.fail(node, "is attention whose queries, keys and values are not all sharded "
                            "by heads")
        return heads

    def _attention(self, node, src, d) -> None:
        q = node.args[0]
        heads = self._heads(node)
        mask = _arg(node, 3, "attn_mask")
        if isinstance(mask, fx.Node) and mask not in self.dim and _val(mask) is not None:
            m = _val(mask)
            aligned = heads - (_val(q).dim() - m.dim())
            if aligned >= 0 and m.shape[aligned] > 1 and not (
                    q in self.blocks and self._slices(node, mask, m, aligned,
                                                      _val(q).shape[heads], [q])):
                self.fail(node, f"adds a bias per head ({mask.name}) that is whole, not "
                                f"sharded by heads")
        self.dim[node] = heads

    def _sink_attention(self, node, src, d) -> None:
        """fxpar.sink_attention(q, k, v, sinks, ...): heads never mix, so it runs by heads like
        SDPA, with the sinks (one per query head, a whole parameter) cut like the query heads.
        That needs each rank's query heads to be its block of them (a column-parallel q)."""
        q, sinks = node.args[0], node.args[3]
        heads = self._heads(node)
        if sinks in self.dim:
            self.fail(node, f"reads sinks {sinks.name} computed from sharded values")
        if q not in self.blocks:
            self.fail(node, f"has query heads ({q.name}) that are not each rank's block of "
                            f"them, so its sinks cannot be cut alike")
        if not self._param_of_full_size(sinks, _val(sinks), 0, _val(q).shape[heads]):
            self.fail(node, f"reads sinks {sinks.name} that are not a trained parameter of one "
                            f"value per query head")
        self.found.cut_params[str(sinks.target)] = 0
        self.dim[node] = heads

    def _matmul(self, node, src, d) -> None:
        self._product(node, *node.args[:2])

    def _product(self, node, a, b) -> None:
        """node = a @ b (with batch dimensions)."""
        va, vb, out = _val(a), _val(b), _val(node)
        if va is None or vb is None or va.dim() < 2 or vb.dim() < 2:
            self.fail(node, "multiplies a sharded vector")
        da, db = self.dim.get(a), self.dim.get(b)
        if da == va.dim() - 1 or db == vb.dim() - 2:
            self.fail(node, "contracts over the sharded dimension (a partial sum, never "
                            "all-reduced)")
        batch_a = None if da is None else (da + out.dim() - va.dim() if da < va.dim() - 2
                                           else out.dim() - 2)
        batch_b = None if db is None else (db + out.dim() - vb.dim() if db < vb.dim() - 2
                                           else out.dim() - 1)
        dims = {x for x in (batch_a, batch_b) if x is not None}
        if len(dims) != 1 or (None in (batch_a, batch_b) and max(dims) < out.dim() - 2):
            self.fail(node, "multiplies a sharded value by one sharded differently or whole "
                            "along a batch dimension")
        self.dim[node] = dims.pop()
        sharded = [t for t in (a, b) if t in self.dim]
        if len({self.outer.get(t, 1) for t in sharded}) > 1:
            self.fail(node, "multiplies values whose sharded dimension holds different merged "
                            "dimensions")
        if all(t in self.blocks for t in sharded):
            self.blocks.add(node)

    def _baddbmm(self, node, src, d) -> None:
        """bias + a @ b (BLOOM's ALiBi scores): the product as a matmul; the bias as an
        elementwise operand of it (sliced when whole)."""
        bias, a, b = node.args[:3]
        self._product(node, a, b)
        if not isinstance(bias, fx.Node):
            return
        out, v = _val(node), _val(bias)
        d = self.dim[node]
        if bias in self.dim:
            if self.dim[bias] + out.dim() - v.dim() != d:
                self.fail(node, "adds a bias sharded on another dimension")
            return
        aligned = d - (out.dim() - v.dim())
        if v is not None and aligned >= 0 and v.shape[aligned] > 1:
            sharded = [t for t in (a, b) if t in self.dim]
            if not (node in self.blocks and self._slices(node, bias, v, aligned, out.shape[d],
                                                          sharded)):
                self.fail(node, f"adds {bias.name}, whole along the sharded dimension (a bias "
                                f"per head that is not sharded by heads)")


def check_layer(gm: fx.GraphModule, layer: str, nodes: list[fx.Node], tp: int,
                whole_heads: set[fx.Node] = frozenset()) -> Findings:
    """Raise ShardingError unless the column/row-parallel rewrite of `nodes` (one layer, in
    graph order, with full shapes in node.meta["val"]) computes exactly what the layer does,
    given the sums and parameter cuts it returns (Findings) are added.
    `whole_heads`: linears kept whole on every rank, of whose output each selects whole heads
    (grouped-query k/v projections whose heads tp does not divide)."""
    gathered: set[fx.Node] = set()
    why: list[str] = []   # why each was gathered: said with a refusal that follows
    while tp > 1:
        try:
            found = _Flow(gm, layer, nodes, tp, whole_heads, gathered).run()
        except GatherNeeded as need:  # one more linear gathered (each at most once)
            gathered.add(need.linear)
            why.append(f"{need.linear.name} gathered whole, as {need.reason}")
            continue
        except ShardingError as err:
            if why:
                raise ShardingError(f"{err}; checked with {'; '.join(why)}") from None
            raise
        found.gathered = gathered
        return found
    return Findings()
