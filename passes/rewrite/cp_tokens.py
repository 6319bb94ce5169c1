"""Does the model work token by token outside its attention? Checked before context parallelism.

Under context parallelism each rank holds a slice of every sequence, and everything but attention
(made a ring) runs on the rank's tokens alone. An op that reads across the sequence elsewhere - a
classifier's mean over the tokens, the first token taken as the sequence's summary (BERT's and
ViT's [CLS]), the last token (a reward model's), a softmax, cumulative sum, flip or convolution
along the sequence, a linear or matmul contracting it - would run on a slice and train to other
numbers without an error. `check_per_token` follows the sequence dimension from the inputs (dim 1
of each input as long as the sequence) through the graph, as views and transposes move it, and
raises ContextParallelError naming the first op that works along it, reduces it or changes its
length. Attention's own ops (found by passes.rewrite.context_parallel) and losses (ops giving a
scalar, averaged over the group) are where reading across tokens is made exact.

What it cannot see it lets pass: once the sequence is merged with a dimension before it (batch and
sequence flattened into rows, as before a cross-entropy), it is no longer followed; nor are the
parts of a split or chunk along it, nor ops inside an attention the ring replaces. Merged with
the dimensions after it, it is followed as their outermost part.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from passes.capture.trace import CONSTANT
from passes.rewrite.tp_views import _arg, _val, op_name

_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze",
          "contiguous", "clone", "to", "_to_copy", "type_as", "float",
          "alias", "detach", "getitem"}
# ops that work along a dimension they are given, keeping its length
_ALONG = {"softmax": 1, "log_softmax": 1, "_softmax": 1, "_log_softmax": 1, "cumsum": 1,
          "cumprod": 1, "cummax": 1, "cummin": 1, "logcumsumexp": 1, "flip": 1, "sort": 1,
          "argsort": 1, "roll": 2}
# reductions, and where their dimension argument is
_REDUCE = {**dict.fromkeys(("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std",
                            "any", "all", "logsumexp", "argmax", "argmin", "median", "var_mean",
                            "std_mean", "count_nonzero"), 1),
           **dict.fromkeys(("topk", "kthvalue", "norm", "linalg_vector_norm"), 2)}
# ops that take positions along a dimension they are given
_TAKE = {"select": 1, "narrow": 1, "slice": 1, "index_select": 1, "gather": 1,
         "take_along_dim": 2}
_CONTRACT_LAST = {"linear", "Linear", "addmm"}
_MATMUL = {"matmul", "bmm", "mm", "baddbmm"}
# ops over the dimensions after (batch, channels): convolutions, pooling, resampling
_CONV = {"conv1d", "conv2d", "conv3d", "convolution", "Conv1d", "Conv2d", "Conv3d",
         "conv_transpose1d", "conv_transpose2d", "ConvTranspose1d", "ConvTranspose2d",
         *(f"{kind}_pool{n}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max", "lp")
           for n in (1, 2, 3)),
         "max_pool1d_with_indices", "max_pool2d_with_indices", "AvgPool1d", "AvgPool2d",
         "MaxPool1d", "MaxPool2d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "LPPool1d",
         "interpolate", "upsample_nearest1d", "upsample_linear1d", "Upsample"}


class SequenceMixError(ValueError):
    """An op outside attention reads across the sequence (see the module docstring)."""


def attention_nodes(output: fx.Node, inputs: set[fx.Node]) -> set[fx.Node]:
    """The nodes of one attention: `output` and what it is computed from, back to `inputs`
    (its q, k, v and mask)."""
    found, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node in found or node in inputs or node.op in ("placeholder", "get_attr"):
            continue
        found.add(node)
        stack.extend(node.all_input_nodes)
    return found


def check_per_token(gm: fx.GraphModule, seq: int, attentions: list) -> None:
    """Raise SequenceMixError unless every op of `gm` but those of `attentions` (found by
    passes.rewrite.context_parallel, each with .output, .q, .k, .v, .mask) works token by token on
    the sequence of `seq` positions. An attention's output keeps its query's sequence dimension."""
    def refuse(node: fx.Node, what: str) -> None:
        raise SequenceMixError(
            f"{node.name} ({op_name(gm, node)}) {what}: under context parallelism each rank holds "
            f"a slice of every sequence, so it would see only its own tokens; plan with cp=1")
    follow_dim(gm, 1, seq, refuse, *outside_attention(attentions))


def outside_attention(attentions: list) -> tuple[set[fx.Node], dict[fx.Node, fx.Node]]:
    """(exempt, outputs) of follow_dim for `attentions`: their own nodes and the mask's
    builders are not followed, and each output keeps its query's sequence dimension."""
    exempt: set[fx.Node] = set()
    for a in attentions:
        exempt |= attention_nodes(a.output, {a.q, a.k, a.v} | ({a.mask} if a.mask else set()))
        if a.mask is not None:  # built from the whole sequence's inputs (passes.rewrite.cp_masks)
            exempt |= attention_nodes(a.mask, set())
    return exempt, {a.output: a.q for a in attentions}


def follow_dim(gm: fx.GraphModule, dim: int, size: int, across, exempt=frozenset(),
               outputs=None, seeds=None) -> dict[fx.Node, int]:
    """Where dimension `dim` of the inputs as long as `size` lies in each value computed from
    them (node -> its position), as views, transposes and ops that keep it move it. An op that
    works across it (reduces it, takes some of its positions, ...) is reported to
    `across(node, what)`, and not followed beyond; nor are `exempt` nodes, and `outputs` maps a
    node to the one whose position it keeps. `seeds` (node -> position) are followed too, and
    the values computed from no input that they lead to (a table's rows by position)."""
    outputs = outputs or {}
    pos: dict[fx.Node, int] = dict(seeds or {})
    for node in gm.graph.nodes:
        out = _val(node)
        if node in pos:
            continue
        if node.op == "placeholder":
            if out is not None and out.dim() > dim and out.shape[dim] == size and \
                    not node.meta.get(CONSTANT):
                pos[node] = dim
            continue
        if node in outputs and outputs[node] in pos:
            pos[node] = pos[outputs[node]]
            continue
        carried = [a for a in node.all_input_nodes if a in pos]
        if not carried or node in exempt or node.op == "output" or (
                node.meta.get(CONSTANT) and not seeds):
            continue
        if out is None and node.target is not operator.getitem and not _tuple_of_tensors(node):
            continue
        found = _follow(gm, node, carried[0], pos)
        if isinstance(found, str):
            across(node, found)
        elif found is not None:
            pos[node] = found
    return pos


def _tuple_of_tensors(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def _follow(gm, node: fx.Node, src: fx.Node, pos: dict) -> int | str | None:
    """Where `node` keeps the sequence dimension of `src`, one of its inputs (None: merged
    away, no longer followed), or what it does across it."""
    name = op_name(gm, node)
    p = pos[src]
    if _val(src) is None:  # a part of a tuple taken by getitem: as long, it keeps the place
        out = _val(node)
        keeps = node.target is operator.getitem and out is not None and out.dim() > p
        return p if keeps else None
    shape = _val(src).shape
    ndim = len(shape)
    if p >= ndim:
        return None
    if name in _ALONG and _dims(node, _ALONG[name], ndim, p):
        return f"works along the sequence (dim {p} of {src.name})"
    if name in _REDUCE and _dims(node, _REDUCE[name], ndim, p, whole=True):
        return f"reduces over the sequence (dim {p} of {src.name})"
    if name in _TAKE and _dims(node, _TAKE[name], ndim, p):
        out = _val(node)
        if out is None or out.dim() <= p or out.shape[p] != shape[p] or name == "select":
            return f"takes some positions of the sequence (dim {p} of {src.name})"
        return p
    if node.target is operator.getitem and _picks(node.args[1], p):
        return f"takes some positions of the sequence (dim {p} of {src.name})"
    moved = _after_index(node.args[1], p) if node.target is operator.getitem else None
    if moved is not None:
        return moved
    if pads(gm, node, ndim, p):
        return f"pads or shifts the sequence (dim {p} of {src.name})"
    if transforms(node, name, ndim, p):
        return f"transforms along the sequence (dim {p} of {src.name})"
    if name == "index" and _indexes(node, p):
        return f"takes some positions of the sequence (dim {p} of {src.name})"
    first = node.args[0] if node.args else None
    if name in _CONTRACT_LAST and first in pos and pos[first] == _val(first).dim() - 1:
        return f"contracts the sequence (the last dim of {first.name})"
    if name == "einsum":  # every operand that carries the sequence, by its letters
        places = {a: _einsum_place(node, a, pos[a]) for a in node.all_input_nodes if a in pos}
        if None not in places.values():
            why = next((w for w in places.values() if isinstance(w, str)), None)
            if why is None and len(set(places.values())) > 1:
                why = (f"puts the positions of two sequences in one value ({node.args[0]}: "
                       f"attention written out; write it with F.scaled_dot_product_attention "
                       f"for context parallelism to ring it)")
            return why or places[src]
    if name in _MATMUL and _contracts(node, pos):
        return "contracts the sequence in a matrix product"
    if name in _CONV and p >= 2:
        return f"convolves or pools along the sequence (dim {p} of {src.name})"
    if name in ("transpose", "swapaxes"):
        d0, d1 = (int(d) % ndim for d in node.args[1:3])
        return d1 if p == d0 else d0 if p == d1 else p
    if name == "t":
        return 1 - p
    if name == "unbind":  # its parts lose the dimension unbound (timm's q, k, v)
        unbound = int(_arg(node, 1, "dim", 0)) % ndim
        return (f"takes some positions of the sequence (dim {p} of {src.name})"
                if unbound == p else p - (unbound < p))
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [int(d) % ndim for d in dims].index(p)
    return _kept(node, shape, p, view=name in _VIEWS)


def _einsum_place(node: fx.Node, src: fx.Node, p: int) -> int | str | None:
    """The sequence's place in an einsum's output, followed by its letter (attention written
    `einsum("bqhd,bkhd->bhqk", q, k)` puts the keys' positions last), or why it is lost; None
    where the equation is not read here (an ellipsis, an operand given twice)."""
    equation, operands = node.args[0], node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if not isinstance(equation, str) or "..." in equation or "->" not in equation or \
            list(operands).count(src) != 1:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    spec = inputs.split(",")[list(operands).index(src)]
    if p >= len(spec):
        return None
    if spec[p] not in out:
        return f"contracts the sequence in an einsum ({equation}, dim {p} of {src.name})"
    return out.index(spec[p])


def _dims(node: fx.Node, index: int, ndim: int, p: int, whole: bool = False) -> bool:
    """Whether the dimension argument of `node` (at `index`, or dim/dims) names dim p; `whole`:
    no dimension means every one (a full reduction)."""
    given = node.kwargs.get("dim", node.kwargs.get("dims", _arg(node, index, "dim")))
    if given is None:
        return whole and _val(node) is not None and _val(node).dim() > 0
    given = given if isinstance(given, (list, tuple)) else [given]
    return any(isinstance(d, int) and not isinstance(d, bool) and d % ndim == p for d in given)


def _picks(index, p: int) -> bool:
    """Whether a Python index (x[:, 0], x[:, -1], x[:, :k]) takes part of dim p."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        return False  # dims counted from the end: not followed
    consumed = [i for i in index if i is not None]
    return len(consumed) > p and consumed[p] != slice(None)


# Fourier transforms and the dimensions they mix when none are given (None: every one)
_FFT_DEFAULT = {
    **dict.fromkeys(("fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft"),
                    (-1,)),
    **dict.fromkeys(("fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2"), (-2, -1)),
    **dict.fromkeys(("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn"), None)}
_FFT_ATEN = {"_fft_c2c", "_fft_r2c", "_fft_c2r"}  # torch.export's forms: dims at index 1


def transforms(node: fx.Node, name: str, ndim: int, p: int) -> bool:
    """Whether a Fourier transform mixes dim p: FNet's token mixing, an FFT along the sequence,
    keeps its length and reads every position."""
    if name in _FFT_ATEN:
        dims = _arg(node, 1, "dim")
    elif name in _FFT_DEFAULT:
        dims = _arg(node, 2, "dim", _FFT_DEFAULT[name])
        if dims is None:
            return True
    else:
        return False
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    return any(not isinstance(d, int) or d % ndim == p for d in dims)


def pads(gm: fx.GraphModule, node: fx.Node, ndim: int, p: int) -> bool:
    """Whether a pad (F.pad, constant_pad_nd, a padding module) pads or cuts dim p: RWKV's token
    shift `F.pad(x, (0, 0, 1, -1))` keeps the sequence's length but moves every token to the
    next position, which on a rank's slice takes a zero where another rank's token belongs."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        is_pad = type(module).__name__[:-2].endswith("Pad") and hasattr(module, "padding")
        widths = module.padding if is_pad else None
    else:
        is_pad = op_name(gm, node) in ("pad", "constant_pad_nd", "reflection_pad1d",
                                       "replication_pad1d", "circular_pad1d")
        widths = _arg(node, 1, "pad")
    if not is_pad:
        return False
    if not isinstance(widths, (list, tuple)):
        return True  # computed: not known not to
    at = 2 * (ndim - 1 - p)  # pairs (before, after), from the last dimension backwards
    return any(w != 0 for w in widths[at:at + 2])


def _after_index(index, p: int) -> int | None:
    """Where dim p lands after a basic index that keeps it whole: integers before it drop their
    dims (`qkv[0]` of [3, b, h, seq, d], `q, k, v = qkv`), None adds one; None where the index
    holds a tensor or an Ellipsis (followed as a view)."""
    index = index if isinstance(index, tuple) else (index,)
    into = out = 0
    for i in index:
        if i is None:
            out += 1
            continue
        if into == p:
            return out
        if isinstance(i, bool) or not isinstance(i, (int, slice)):
            return None
        into, out = into + 1, out + isinstance(i, slice)
    return out + p - into


def _indexes(node: fx.Node, p: int) -> bool:
    """aten.index(x, indices): whether an index tensor stands at dim p."""
    indices = _arg(node, 1, "indices")
    return isinstance(indices, (list, tuple)) and len(indices) > p and indices[p] is not None


def _contracts(node: fx.Node, pos: dict) -> bool:
    """Whether a matrix product contracts the sequence: the last dim of its first factor, the
    next-to-last of its second."""
    args = [a for a in node.args if isinstance(a, fx.Node)]
    a, b = (args[-2:] if len(args) >= 2 else args + [None])[:2]
    if a in pos and _val(a) is not None and pos[a] == _val(a).dim() - 1:
        return True
    return b in pos and _val(b) is not None and _val(b).dim() >= 2 and \
        pos[b] == _val(b).dim() - 2


def _kept(node: fx.Node, shape, p: int, view: bool) -> int | str | None:
    """The sequence's place in `node`'s output: after as many elements as before (a view), or
    left- or right-aligned (reductions over later dims, elementwise ops that broadcast)."""
    out = _val(node)
    if out is None:  # a tuple (split, chunk along another dimension): its parts keep it
        return p
    seq = shape[p]
    if view:  # followed where it stays in place, alone or merged with the dims after it,
        # past dims of size 1 put before it (a table of rows viewed as [1, seq, 1, d])
        before = math.prod(shape[:p])
        for q in range(out.dim()):
            if math.prod(out.shape[:q]) == before and out.shape[q] % seq == 0 and out.shape[q]:
                return q
            if math.prod(out.shape[:q + 1]) > before:
                break
        if out.numel() == math.prod(shape):
            return None  # merged with another dimension
        return f"takes some positions of the sequence ({seq} in, {tuple(out.shape)} out)"
    if out.dim() > p and tuple(out.shape[:p + 1]) == tuple(shape[:p + 1]):
        return p  # the same leading dimensions (an embedding, a reduction over later ones)
    right = p + out.dim() - len(shape)  # broadcast against a value of more dimensions
    if 0 <= right < out.dim() and out.shape[right] == seq:
        return right
    if out.dim() == 0:
        return None  # a loss, averaged over the group
    return f"changes the sequence's length ({seq} positions in, {tuple(out.shape)} out)"
