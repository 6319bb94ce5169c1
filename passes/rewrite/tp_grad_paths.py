"""Where the gradients of whole values computed from a norm's statistics are summed over tp ranks.

Every tp rank holds a whole value (the same on each), but what comes back to it in backward is
one of two kinds of share: *full* (the whole gradient, the same on every rank: from whole
readers, the layer's output) or *partial* (the ranks' values sum to it: from a reader that is
sharded over the features, each rank's part of the product giving that part's share). A value may
receive only one kind; where both meet, one is converted:

- tp_copy (backward: all-reduce) makes partial shares full. The rewrite reads through it every
  whole operand with a gradient of a sharded op (Findings.broadcast), so whole values are full.
- tp_sum, after the sum over the sharded features of a norm's statistics (Findings.reduced),
  all-reduces what comes back, so the values computed from those statistics alone must stay
  partial: none of them is read through tp_copy. A full share read from them (the statistics
  also returned or added whole) is read through tp_grad_share (backward: divide by tp), partial
  again.

A value computed from the statistics and from another source with a gradient (`alpha * rstd`,
the product of two inverse RMS, one over the sharded features and one over the block's input) is
*mixed*. It stays partial when all its readers are sharded ops or partial mixed values: then its
other sources are read through tp_copy where they come in. Otherwise it is full: its sharded
readers read it through tp_copy and its operands from the statistics through tp_grad_share.
`share_fixes` works out the kind of every such value of a layer and the reads to convert.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from passes.rewrite.sharding import linear_site
from passes.rewrite.value_sources import carries_grad, is_size

_COMPUTE = ("call_function", "call_method", "call_module")


@dataclass
class ShareFixes:
    """Reads (reader, operand) to convert: through tp_copy, or through tp_grad_share."""

    copies: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)
    shares: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)
    # a module with parameters of its own applied to such values: its parameters would get
    # each rank's share of their gradient, summed nowhere (the layer is refused)
    module: fx.Node | None = None
    # the whole values computed from the statistics (the rest are read through tp_copy where
    # they meet sharded values: Findings.broadcast)
    region: set[fx.Node] = field(default_factory=set)


def _region(gm, nodes: list[fx.Node], reduced, sharded) -> tuple[set, set]:
    """The whole values computed from the statistics, and those of them also computed from
    another source with a gradient (mixed)."""
    region, mixed = set(reduced), set()
    for node in nodes:
        if node in region or node in sharded or node.op not in _COMPUTE or \
                linear_site(gm, node) is not None:
            continue
        inputs = node.all_input_nodes
        if not any(a in region for a in inputs):
            continue
        region.add(node)
        if any(a in mixed or a not in region and a not in sharded and carries_grad(gm, a)
               for a in inputs):
            mixed.add(node)
    return region, mixed


def share_fixes(gm: fx.GraphModule, nodes: list[fx.Node], reduced, sharded) -> ShareFixes:
    """The reads to convert in one layer (`nodes` in graph order) so that every whole value
    computed from summed statistics receives one kind of share (see the module docstring)."""
    region, mixed = _region(gm, nodes, reduced, sharded)
    partial = {n for n in region if n not in mixed}
    for node in reversed(nodes):  # readers first
        if node in mixed and all(u in sharded or u in partial for u in node.users):
            partial.add(node)
    fixes = ShareFixes(module=next((n for n in region if n.op == "call_module" and any(
        True for _ in gm.get_submodule(n.target).parameters())), None), region=region)
    for node in region:
        for reader in node.users:
            if is_size(reader):
                continue
            gives_partial = reader in sharded or reader in partial
            if node in partial and not gives_partial:
                fixes.shares.append((reader, node))
            elif node not in partial and gives_partial:
                fixes.copies.append((reader, node))
    for node in mixed & partial:
        for arg in node.all_input_nodes:
            if arg not in region and arg not in sharded and carries_grad(gm, arg):
                fixes.copies.append((node, arg))
    return fixes
