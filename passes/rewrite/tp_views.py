"""The tensor-parallel dataflow check's rules for views and dimension moves
(passes.rewrite.tp_dataflow): where the sharded dimension goes through a view, transpose,
permute, movedim or unbind, and when a view of a fused projection by parts (timm's
`qkv.reshape(B, N, 3, heads, head_dim)`) is cut per part."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from passes.rewrite.sharding import linear_site


def op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """'add', 'softmax', 'Linear', ...: the op's bare name in any capture form."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    if node.op == "call_method":
        return str(node.target).removesuffix("_")
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # add_: add, in place
        return target.overloadpacket.__name__.removesuffix("_")
    return getattr(target, "__name__", str(target)).removesuffix("_")


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _moved_by_unit(before, after, j: int) -> int | None:
    """Where dimension j of a shape goes when unit dimensions are inserted or removed (an
    unsqueeze, a squeeze); None where j itself is removed."""
    i = k = 0
    while i < len(before) and k < len(after):
        if before[i] == after[k] and (before[i] != 1 or len(before) - i == len(after) - k):
            if i == j:
                return k
            i, k = i + 1, k + 1
        elif after[k] == 1 and len(after) - k > len(before) - i:
            k += 1   # inserted
        elif before[i] == 1:
            if i == j:
                return None
            i += 1   # removed
        else:
            return None
    return None


class ViewRules:
    """Rules of tp_dataflow._Flow for views: each sets self.dim[node] or fails."""

    def _view(self, node, src, d) -> None:
        full_in, full_out = tuple(_val(src).shape), tuple(_val(node).shape)
        # The sharded dimension may hold dimensions merged in front of it (outer): it is then
        # read as (outer, size) with the second one sharded.
        outer = self.outer.get(src, 1)
        size_d = full_in[d] // outer
        before = math.prod(full_in[:d]) * outer
        prefix = 1
        # Splitting the sharded dimension into (heads, head_dim) puts it on the heads, also when
        # there is one: multi-query k/v (kept whole, one head selected) or a head tp cuts. Other
        # unit dimensions at its place are inserted ones (unsqueeze) and skipped.
        dim = _arg(node, 1, "dim")
        unflatten = op_name(self.gm, node) == "unflatten" and isinstance(dim, int) \
            and dim % len(full_in) == d
        heads_first = src in self.whole_heads or unflatten
        # an unflatten's new dimensions start at d: a unit dimension before it (a batch of one)
        # is not a head
        first = d if unflatten else 0
        if src in self.whole_heads:
            self.whole_heads.add(node)
        for j, size in enumerate(full_out):
            if prefix == before and (size > 1 or (heads_first and j >= first)):
                carved = size_d // size if size < size_d else 1
                cuts = size < size_d and (size_d // self.tp) % max(carved, 1)
                if (cuts or self._selects(node, j) or self._piece_parts(src) == size) and \
                        src not in self.whole_heads:
                    if self._parted_view(node, src, j, size, size_d, full_out):
                        return
                if cuts and src not in self.whole_heads:
                    self.fail(node, f"splits the sharded dimension ({size_d} over "
                                    f"tp={self.tp}) into {size} pieces of {carved} (heads, "
                                    f"if they are), cutting one: {size} do not divide over "
                                    f"tp={self.tp}")
                self.dim[node] = j
                self.outer[node] = 1
                if src in self.blocks and src not in self.whole_heads:
                    self.blocks.add(node)
                return
            heads = prefix * size // before if before % prefix == 0 else 0
            if (prefix < before < prefix * size and heads and (prefix * size) % before == 0
                    and size_d % heads == 0 and heads % self.tp == 0
                    and src not in self.whole_heads):
                # merged, innermost, with dimensions before it (BLOOM's batch x heads), whole
                # or its leading `heads` only, the rest in the dimensions after it
                # (nn.MultiheadAttention's (batch x heads, head_dim)): each rank holds its part
                # of the sharded dimension in every one of them
                self.dim[node], self.outer[node] = j, before // prefix
                if src in self.blocks:
                    self.blocks.add(node)
                return
            prefix *= size
        self.fail(node, "merges the sharded dimension with the dimensions before it")

    def _parted_view(self, node, src, j: int, parts: int, size_d: int, full_out) -> bool:
        """A column-parallel output viewed, right after its linear, as (parts, heads, ...) -
        timm's fused `qkv.reshape(B, N, 3, heads, head_dim)`, PixArt's kv as (2, heads, d): cut
        per part, as a fused QKV is (each rank holds its heads of every part), the sharded
        dimension is the heads. Where the view is not of that form, False (refused)."""
        linear = src
        if linear not in self.blocks or linear_site(self.gm, linear) is None or \
                len(linear.users) != 1 or j + 1 >= len(full_out):
            return False
        # (parts, features) and (heads, head_dim) have the same shape: parts are taken apart
        # later or have a head dimension after them; else these are heads tp cuts (refused)
        if j + 2 >= len(full_out) and not self._selects(node, j) and \
                self._piece_parts(src) != parts:
            return False
        heads = full_out[j + 1]
        if parts * heads > size_d or size_d % (parts * heads) or heads % self.tp:
            return False
        self.found.parted[linear], self.found.parted_views[node] = parts, parts
        self.blocks.discard(linear)  # each rank's part is a block of every part, not one block
        self.blocks.add(node)
        self.dim[node], self.outer[node] = j + 1, 1
        return True

    def _piece_parts(self, linear: fx.Node) -> int:
        """The parts a linear's weight covers where it is a piece of a parameter cut in the graph
        (passes.rewrite.weight_pieces: the kv rows of a cross-attention's in-projection), 0 for
        one part or another linear: its output is read by those parts."""
        site = linear_site(self.gm, linear)
        return site.piece.parts if site is not None and site.piece is not None and \
            site.piece.parts > 1 else 0

    def _selects(self, node: fx.Node, j: int) -> bool:
        """Whether dimension j of `node` is taken apart later (unbind, select, an int index),
        through permutes, transposes and unit dimensions inserted or removed
        (nn.MultiheadAttention's `unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)`):
        q, k, v of a fused projection viewed by parts."""
        for user in node.users:
            name, k = op_name(self.gm, user), j
            if name in ("unsqueeze", "squeeze") and _val(user) is not None:
                k = _moved_by_unit(_val(node).shape, _val(user).shape, j)
            elif name in ("contiguous", "clone"):
                pass
            elif name == "permute":
                dims = user.args[1] if isinstance(user.args[1], (tuple, list)) else user.args[1:]
                ndim = len(dims)
                k = [d % ndim if isinstance(d, int) else d for d in dims].index(j) \
                    if j in [d % ndim for d in dims if isinstance(d, int)] else None
            elif name in ("transpose", "swapaxes") and len(user.args) > 2:
                ndim = _val(node).dim() if _val(node) is not None else 0
                a, b = (x % ndim if isinstance(x, int) and ndim else x for x in user.args[1:3])
                k = b if j == a else a if j == b else j
            elif name in ("unbind", "select"):
                if _arg(user, 1, "dim", 0) % max(_val(node).dim(), 1) == j:
                    return True
                continue
            elif user.target is operator.getitem and isinstance(user.args[1], int):
                if j == 0:  # qkv[0]
                    return True
                continue
            elif user.target is operator.getitem and isinstance(user.args[1], tuple):
                index = user.args[1]
                if Ellipsis not in index and j < len(index) and isinstance(index[j], int):
                    return True
                continue
            else:
                continue
            if k is not None and self._selects(user, k):
                return True
        return False

    def _int(self, node, x):
        """An int argument of `node`, also one the graph computed (a traced `x.dim() - 1`: its
        value as shape propagation recorded it); else the node is refused, named."""
        if isinstance(x, fx.Node):
            value = x.meta.get("val")
            if not isinstance(value, int) or isinstance(value, bool):
                self.fail(node, f"takes a dimension from {x.name}, which is not a constant the "
                                f"capture recorded (write the dimension as a number)")
            return value
        return x

    def _transpose(self, node, src, d) -> None:
        ndim = _val(src).dim()
        a, b = (node.args[1], node.args[2]) if len(node.args) > 2 else (0, 1)
        a, b = self._int(node, a) % ndim, self._int(node, b) % ndim
        self.dim[node] = b if d == a else a if d == b else d
        if src in self.blocks:
            self.blocks.add(node)

    def _permute(self, node, src, d) -> None:
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
        ndim = _val(src).dim()
        self.dim[node] = [self._int(node, x) % ndim for x in dims].index(d)

    def _movedim(self, node, src, d) -> None:
        ndim = _val(src).dim()
        source, dest = _arg(node, 1, "source"), _arg(node, 2, "destination")
        source = source if isinstance(source, (tuple, list)) else (source,)
        dest = dest if isinstance(dest, (tuple, list)) else (dest,)
        source = [self._int(node, x) % ndim for x in source]
        dest = [self._int(node, x) % ndim for x in dest]
        rest = iter(i for i in range(ndim) if i not in source)
        order = [None] * ndim  # output dim -> input dim, as torch.movedim places them
        for s, t in zip(source, dest):
            order[t] = s
        order = [o if o is not None else next(rest) for o in order]
        self.dim[node] = order.index(d)

    def _unbind(self, node, src, d) -> None:
        """The parts along another dimension (q, k, v of a fused projection viewed by parts)."""
        dim = self._int(node, _arg(node, 1, "dim", 0)) % _val(src).dim()
        if dim == d:
            self.fail(node, "unbinds the sharded dimension")
        self.dim[node] = d - (dim < d)

    def _complex(self, node, src, d) -> None:
        """view_as_complex / view_as_real (rotary embeddings as complex products, Meta's Llama
        and torchtitan): pairs of the last dimension as one complex number, the other
        dimensions in place; the pair itself must not be the sharded dimension."""
        if d == _val(src).dim() - 1 and op_name(self.gm, node) == "view_as_complex":
            self.fail(node, "makes complex numbers of pairs along the sharded dimension")
        self.dim[node] = d
        if src in self.blocks:
            self.blocks.add(node)

    def _pad(self, node, src, d) -> None:
        """F.pad: pairs of sizes from the last dimension back; the sharded one must get none."""
        pads = _arg(node, 1, "pad")
        ndim = _val(src).dim()
        if not isinstance(pads, (list, tuple)):
            self.fail(node, "pads by sizes the capture did not record as numbers")
        pair = ndim - 1 - d
        if any(pads[2 * pair:2 * pair + 2]):
            self.fail(node, "pads the sharded dimension")
        self.dim[node] = d

    def _einsum(self, node, src, d) -> None:
        """torch.einsum with an explicit output: the sharded dimension's letter must be kept in
        the output (not summed over) and read sharded, or broadcast, by every operand holding
        it - attention over heads written as '...qhd,...khd->...hqk' (LongT5's local attention)."""
        equation = _arg(node, 0, "equation")
        operands = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        if not isinstance(equation, str) or "->" not in equation:
            self.fail(node, "is an einsum without an explicit output ('->'); write it out")
        inputs, output = equation.replace(" ", "").split("->")
        inputs = inputs.split(",")
        width = max(_val(x).dim() - len(s.replace("...", "")) for s, x in zip(inputs, operands))
        specs = [_einsum_spec(s, _val(x).dim(), width) for s, x in zip(inputs, operands)]
        out = _einsum_spec(output, None, width)
        letters = {specs[i][self.dim[x]] for i, x in enumerate(operands) if x in self.dim}
        letter = letters.pop() if len(letters) == 1 else None
        if letter is None or any(self.outer.get(x, 1) > 1 for x in operands if x in self.dim):
            self.fail(node, "reads values sharded along different letters of its equation")
        if letter not in out:
            self.fail(node, f"sums over the sharded dimension ('{letter}' of {equation!r})")
        for spec, x in zip(specs, operands):
            if letter in spec and x not in self.dim and _val(x).shape[spec.index(letter)] > 1:
                self.fail(node, f"combines a sharded value with {x.name}, whole along the "
                                f"sharded dimension ('{letter}' of {equation!r})")
        self.dim[node] = out.index(letter)


def _einsum_spec(spec: str, ndim: int | None, width: int) -> str:
    """An einsum operand's letters with '...' spelt out, one digit per dimension numbered from
    the right of the widest operand's `width`, so that broadcast dimensions line up (ndim None:
    the output, `width` wide)."""
    if "..." not in spec:
        return spec
    count = width if ndim is None else ndim - (len(spec) - 3)
    return spec.replace("...", "".join(str(i) for i in range(width - count, width)))
