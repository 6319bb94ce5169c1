"""Positions under context parallelism: each rank's tokens are at global positions of the
sequence (runtime.programs.token_split's zig-zag chunks), held by the graph's buffer
POSITIONS_BUFFER, and whatever the graph indexes by position is read there.

  fix_positions           torch.narrow(table, d, 0, seq) or table[:seq] of a table indexed by
                          position (GPT's position ids, Llama's rotary cos/sin) -> index_select
                          at the rank's positions; arange(seq) -> those positions. Other aranges
                          or cuts computed from the sequence length are refused.
  select_whole_constants  a value built from constants over [batch, seq, ...] (OPT's cumulative
                          sum of ones) is read at the positions where per-token values meet it.
  whole_meets,            a value computed from no input that spans the sequence (a rotary
  read_at_positions       table read whole, a learned position parameter) is read at the
                          positions where it meets the rank's tokens.
  position_seeds          what fix_positions rewrites, for whole_meets to follow.

Rewritten tables keep their full value in meta["val"], so that passes.rewrite.sharding's
localize_shapes divides the literal sizes of their views by the cut.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from passes.capture.trace import CONSTANT
from passes.rewrite.cp_masks import WHOLE
from passes.rewrite.cp_tokens import follow_dim
from passes.rewrite.sharding import LAYER
from passes.rewrite.tables import table
from passes.rewrite.tp_views import _val, op_name
from runtime.programs.token_split import global_positions

POSITIONS_BUFFER = "cp_positions"


class ContextParallelError(ValueError):
    """The graph cannot be run context-parallel; names the attention node and the reason."""


def fix_positions(gm: fx.GraphModule, seq: int, cp: int, rank: int, layout: str) -> None:
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
            positions_buffer(gm, seq, cp, rank, layout)
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
        positions_buffer(gm, seq, cp, rank, layout)
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


def position_seeds(gm: fx.GraphModule, seq: int) -> dict[fx.Node, int]:
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


def select_whole_constants(gm: fx.GraphModule, seq: int, cp: int, rank: int,
                            layout: str) -> None:
    """A value built in the graph from constants alone over the whole sequence ([batch, seq,
    ...]: OPT's positions, a cumulative sum of ones) is read at this rank's tokens
    (index_select on dim 1) where per-token values meet it. Values computed from this rank's
    positions are local already, and the whole-sequence mask builders stay whole."""
    local = computed_from(gm, {node for node in gm.graph.nodes
                               if (node.op, node.target) == ("get_attr", POSITIONS_BUFFER)})
    for node in list(gm.graph.nodes):
        if not (_over_sequence(node, seq) and not node.meta.get(WHOLE) and node not in local):
            continue
        readers = [u for u in node.users if not u.meta.get(CONSTANT) or u in local]
        if not readers:
            continue
        positions_buffer(gm, seq, cp, rank, layout)
        with gm.graph.inserting_after(node):
            positions = gm.graph.get_attr(POSITIONS_BUFFER)
        with gm.graph.inserting_after(positions):
            mine = gm.graph.call_function(torch.index_select, (node, 1, positions))
        mine.meta = {k: v for k, v in node.meta.items() if k == LAYER}
        for reader in readers:
            reader.replace_input_with(node, mine)


def _over_sequence(node: fx.Node, seq: int) -> bool:
    """A value computed from constants alone as [batch, seq, ...] (select_whole_constants')."""
    val = node.meta.get("val")
    return bool(node.meta.get(CONSTANT)) and isinstance(val, torch.Tensor) and val.dim() >= 2 \
        and val.shape[1] == seq


def positions_buffer(gm: fx.GraphModule, seq: int, cp: int, rank: int, layout: str) -> None:
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
    if not is_call(node, _ARANGE):
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
    if not (is_call(node, _CUTS) and _is_table(node.args[0])):
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
    return is_call(node, _ARANGE) or (is_call(node, _CUTS) and _is_table(node.args[0]))


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
    if is_method(node, "size") or is_call(node, {torch.ops.aten.sym_size.int}):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        return (node.args[0], dim) if isinstance(dim, int) else None
    if not (is_call(node, {operator.getitem}) and isinstance(node.args[1], int)):
        return None
    shape = node.args[0]
    if (is_method(shape, "size") and len(shape.args) == 1 and not shape.kwargs) or \
            (is_call(shape, {getattr}) and shape.args[1] == "shape"):
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


# ---------------------------------------------------------------- whole values meeting tokens
# A rotary table read whole ([seq, d], or viewed [1, seq, 1, d] as torch.export records
# freqs_cis.view(1, seq, 1, d)) or a learned position parameter ([1, seq, h], trained) would
# meet the rank's tokens with every position's entry. Found on the captured graph before the
# rewrite, from where the sequence lies in each value (cp_tokens.follow_dim, from the inputs and
# from position_seeds): an elementwise op between a value holding the sequence and one computed
# from no input as long as the sequence along the same dim. That value is then read at the
# rank's positions (a parameter's gradient lands at those positions; the group's sum of
# gradients adds the ranks' parts).

_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "where", "masked_fill", "addcmul", "lerp",
                "maximum", "minimum", "pow", "rsub"}


Meet = tuple[fx.Node, fx.Node, int]  # (reader, whole operand, its dim along the sequence)


def whole_meets(gm: fx.GraphModule, seq: int, exempt: set, outputs: dict,
                seeds: dict) -> list[Meet]:
    """The whole values of `gm` (still of the whole sequence's shapes) that meet its tokens;
    `exempt` and `outputs` as for follow_dim (attention's own nodes, which the ring replaces),
    `seeds` the position tables and ranges context_parallel cuts (node -> dim of positions)."""
    pos = follow_dim(gm, 1, seq, lambda node, what: None, exempt, outputs, seeds)
    # computed from an input, or from what fix_positions and select_whole_constants make the
    # rank's: local however follow_dim lost them
    from_inputs = computed_from(gm, {*seeds, *(n for n in gm.graph.nodes if n.op == "placeholder"
                                               or _over_sequence(n, seq))})
    meets = []
    for node, p in pos.items():
        out = _val(node)
        if node.op not in ("call_function", "call_method") or out is None or \
                op_name(gm, node) not in _ELEMENTWISE:
            continue
        for a in node.all_input_nodes:
            v = _val(a)
            if a in pos or a in from_inputs or v is None:
                continue
            dim = p - (out.dim() - v.dim())
            if 0 <= dim < v.dim() and v.shape[dim] == seq:
                meets.append((node, a, dim))
    return meets


def read_at_positions(gm: fx.GraphModule, meets: list[Meet]) -> None:
    """Read each whole operand of `meets` at the rank's positions (POSITIONS_BUFFER), in
    place."""
    for reader, whole, dim in meets:
        if whole not in reader.all_input_nodes:
            continue  # already read at the rank's positions (context_parallel's constants)
        with gm.graph.inserting_before(reader):
            rows = gm.graph.get_attr(POSITIONS_BUFFER)
            mine = gm.graph.call_function(torch.index_select, (whole, dim, rows))
        for new in (rows, mine):
            new.meta = {k: v for k, v in reader.meta.items() if k != "val"}
        reader.replace_input_with(whole, mine)


def computed_from(gm: fx.GraphModule, starts) -> set[fx.Node]:
    """`starts` and every node computed from one of them."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in starts or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def is_call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and \
        node.target in targets


def is_method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name
