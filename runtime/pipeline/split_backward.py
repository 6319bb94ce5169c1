"""The split backward of zero-bubble schedules: I computes a stage's input gradients, W its weight
gradients later, without W redoing what I did.

A backward towards the weights alone would re-traverse the whole path the input gradient took
(for a transformer block: attention, the norms, every matmul's input half), about one more
input-gradient pass. Instead, as torch.distributed.pipelining's stage_backward_input / _weight
do (Qi et al., "Zero Bubble Pipeline Parallelism", 2023), I records the gradient that arrives at
each *join*: a node of the autograd graph on the input's path where a parameter's own path (the
weight's transposes and casts) meets it: for a linear layer its matmul, for a norm the norm. W
then starts a backward at each join from that recorded gradient towards the join's parameters:
only the weights' halves of those nodes run.

Parameters whose joins overlap form one group, run as one backward; within a group a join that
lies below another would also receive the upper one's contribution, so each join's recorded
gradient is pinned by a pre-hook while W runs. A parameter with a path that reaches an output
without meeting the input path is left to one backward from the stage's outputs, as before.

Memory: the recorded gradients (one per join: for a transformer block about the size of its
matmuls' outputs, 0.8 of its saved activations for torch's TransformerEncoderLayer) live from I
until W, beside the activations that live until W anyway; on rank r of ZB-H1, whose W trails its
I by r micro-batches, that is up to r + 1 sets more. A plan prices them where it chose this form
(planner.search.meshes.split_forms: cost_model LayerCost.record_bytes, the schedule's moments
after each I), so the executor takes this way only then (TrainOptions.split_backward "record",
or "auto" with such a plan), and never for a stage that recomputes layers (`recomputes`): each
of W's backwards is a graph task of
its own, and non-reentrant checkpointing recomputes a region once per task that reaches it, so a
checkpointed block would run its forward again per group (twice for two linears) where the plain
backward from the outputs runs it once.

The walk over the autograd graph costs a few microseconds per node, once per micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

# How W gets the weight gradients (runtime.pipeline.executor.StageExecutor): "retraverse" runs
# a backward from the stage's outputs again, "record" this module's way.
SPLIT_BACKWARDS = ("retraverse", "record")

# The attribute marking a module that runs a region under activation checkpointing
# (passes.rewrite.recompute): W's backwards from records would each recompute it again.
RECOMPUTED = "fxpar_recomputed"


def recomputes(module: torch.nn.Module) -> bool:
    """Whether `module` (a stage program) recomputes a region in its backward."""
    return any(getattr(m, RECOMPUTED, False) for m in module.modules())


@dataclass
class Group:
    """Parameters whose weight gradients start from the same joins."""

    params: list[torch.Tensor]
    joins: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)  # recorded by I, per join


@dataclass
class Deferred:
    """What I leaves for W: the groups, and the parameters no join reaches (with the outputs
    and their gradients, to run the plain backward towards them)."""

    groups: list[Group]
    rest: list[torch.Tensor]
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor]


def _node(t: torch.Tensor) -> Node | None:
    """A tensor's grad_fn, or its AccumulateGrad node for a leaf (created on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0] if t.requires_grad else None


def _order(node: Node) -> int:
    """A stable order of nodes (creation order), so runs sum gradients in the same order."""
    return node._sequence_nr()


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Node -> the nodes whose backward feeds a gradient into it (next_functions reversed)."""
    consumers: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(roots)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in consumers:
                consumers[nxt] = []
                stack.append(nxt)
            consumers[nxt].append(node)
    return consumers


def _above(starts: list[Node], consumers: dict) -> set[Node]:
    """Nodes reachable from `starts` towards the outputs, `starts` included."""
    seen, stack = set(starts), list(starts)
    while stack:
        for up in consumers[stack.pop()]:
            if up not in seen:
                seen.add(up)
                stack.append(up)
    return seen


def _joins(node: Node, consumers: dict, on_input_path: set[Node]) -> set[Node] | None:
    """Where a parameter's path meets the input path; None when some of it reaches an output
    on its own, without meeting it (W then needs the backward from the outputs)."""
    joins, seen, stack = set(), {node}, [node]
    while stack:
        ups = consumers[stack.pop()]
        if not ups:
            return None
        for up in ups:
            if up in on_input_path:
                joins.add(up)
            elif up not in seen:
                seen.add(up)
                stack.append(up)
    return joins


def _leaf_node(p: torch.Tensor, cache: dict, graph: dict) -> Node:
    """A parameter's AccumulateGrad node in `graph`, kept in `cache`: while it is held, autograd
    reuses it for every graph (as DistributedDataParallel keeps its parameters'), so it is
    made once. Not always: setting a parameter's .data to another dtype (the fp32 main weights'
    step, runtime.training.main_weights) makes autograd drop the parameter's node for a new one,
    so a cached node the graph does not hold is looked up again (else every weight would look
    unused and get no gradient from then on)."""
    node = cache.get(id(p))
    if node is None or node.variable is not p or node not in graph:
        node = cache[id(p)] = _node(p)
    return node


def _groups(roots, inputs, params, cache: dict) -> tuple[list[Group], list[torch.Tensor]]:
    consumers = _consumers([n for n in map(_node, roots) if n is not None])
    on_input_path = _above([n for n in map(_node, inputs) if n in consumers], consumers)
    by_join: dict[Node, Group] = {}
    rest = []
    for p in params:
        node = _leaf_node(p, cache, consumers)
        if node not in consumers:
            continue  # unused this micro-batch: no gradient
        joins = _joins(node, consumers, on_input_path)
        if joins is None:
            rest.append(p)
            continue
        merged = {id(by_join[j]): by_join[j] for j in joins if j in by_join}
        group = Group([p], sorted(joins, key=_order))
        for other in merged.values():
            group.params += other.params
            group.joins += [j for j in other.joins if j not in group.joins]
        group.joins.sort(key=_order)
        for j in group.joins:
            by_join[j] = group
    unique = {id(g): g for g in by_join.values()}
    # Latest joins first, the order a backward meets them: sharded data parallel (level 3)
    # gathers each unit's parameters once per backward, walking the units in reverse.
    return sorted(unique.values(), key=lambda g: -_order(g.joins[-1])), rest


def input_backward(roots: list[torch.Tensor], root_grads: list[torch.Tensor],
                   inputs: list[torch.Tensor], params: list[torch.Tensor], cache: dict):
    """I: the gradients of `inputs` (None where unreached), and the Deferred for W. `cache`
    keeps the parameters' AccumulateGrad nodes from one call to the next."""
    groups, rest = _groups(roots, inputs, params, cache)
    handles = []
    for group in groups:
        for join in group.joins:
            def record(grad_outputs, group=group, join=join):
                group.grads[join] = grad_outputs
            handles.append(join.register_prehook(record))
    try:
        grads = torch.autograd.grad(roots, inputs, root_grads, retain_graph=True,
                                    allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return grads, Deferred(groups, rest, roots, root_grads)


def weight_backward(deferred: Deferred) -> None:
    """W: accumulate every parameter's gradient into .grad (hooks fire as for any backward)."""
    for group in deferred.groups:
        edges, grads = [], []
        for join in group.joins:
            for i, g in enumerate(group.grads.get(join, ())):
                if g is not None:
                    edges.append(GradientEdge(join, i))
                    grads.append(g)
        if not edges:
            continue
        pins = [join.register_prehook(lambda _, saved=group.grads.get(join): saved)
                for join in group.joins if len(group.joins) > 1 and join in group.grads]
        try:
            # The graph stays for the other groups' and the rest's backward; it goes with
            # the slot, once W returns.
            torch.autograd.backward(edges, grads, inputs=group.params, retain_graph=True)
        finally:
            for pin in pins:
                pin.remove()
    if deferred.rest:
        torch.autograd.backward(deferred.roots, deferred.root_grads, inputs=deferred.rest)
