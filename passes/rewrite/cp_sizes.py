"""Values computed from no input that span the whole sequence, read at a context-parallel rank's
positions where they meet its tokens.

Under context parallelism a rank holds seq/cp positions of each sequence. context_parallel cuts
the position tables it recognises (`table[:seq]`, `arange(seq)`) and values built from constants
over `[batch, seq, ...]`; a rotary table read whole (`[seq, d]`, or viewed `[1, seq, 1, d]` as
torch.export records `freqs_cis.view(1, seq, 1, d)`) or a learned position parameter
(`[1, seq, h]`, trained) would still meet the rank's tokens with every position's entry, and
not run. Found on the captured graph, before the rewrite (`find`), from where the sequence lies
in each value (`cp_tokens.follow_dim`, from the inputs and from the tables context_parallel
cuts): an elementwise op between a value holding the sequence and one computed from no input as
long as the sequence along the same dim. `localise` reads that value at the rank's positions,
index_select(value, dim, positions) (a parameter's gradient then lands at those positions, and
the group's sum of gradients adds the ranks' parts). Literal sizes of views need nothing here:
passes.rewrite.sharding.localize_shapes divides them by the cut of their input."""
from __future__ import annotations

import torch
import torch.fx as fx

from passes.rewrite.cp_tokens import follow_dim
from passes.rewrite.tp_views import _val, op_name

_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "where", "masked_fill", "addcmul", "lerp",
                "maximum", "minimum", "pow", "rsub"}


Meet = tuple[fx.Node, fx.Node, int]  # (reader, whole operand, its dim along the sequence)


def find(gm: fx.GraphModule, seq: int, exempt: set, outputs: dict, seeds: dict) -> list[Meet]:
    """The whole values of `gm` (still of the whole sequence's shapes) that meet its tokens;
    `exempt` and `outputs` as for follow_dim (attention's own nodes, which the ring replaces),
    `seeds` the position tables and ranges context_parallel cuts (node -> dim of positions)."""
    pos = follow_dim(gm, 1, seq, lambda node, what: None, exempt, outputs, seeds)
    from_inputs = _from_inputs(gm)
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


def localise(gm: fx.GraphModule, meets: list[Meet], positions: str) -> None:
    """Read each whole operand of `meets` at the positions held by the buffer named
    `positions` (this rank's, global), in place."""
    for reader, whole, dim in meets:
        if whole not in reader.all_input_nodes:
            continue  # already read at the rank's positions (context_parallel's constants)
        with gm.graph.inserting_before(reader):
            rows = gm.graph.get_attr(positions)
            mine = gm.graph.call_function(torch.index_select, (whole, dim, rows))
        for new in (rows, mine):
            new.meta = {k: v for k, v in reader.meta.items() if k != "val"}
        reader.replace_input_with(whole, mine)


def _from_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from an input of the graph (the others: constants and parameters)."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found
