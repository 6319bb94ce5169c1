"""Activation recomputation: regions of the graph run under torch.utils.checkpoint.

  full       the whole layer ("full" in the strategy): only its inputs are kept for backward
  selective  the attention core ("sel"): from q, k, v to the attention output - the sdpa call
             (or fxpar's sink attention), or the written-out scores / mask / softmax / dropout /
             (att @ v) whose values are [..., s, s] - so the s² tensors are not kept; everything
             else is

A region becomes one call_module node, `recompute_<kind>_<layer>`, whose module is a small
GraphModule: `checkpointed(body, *inputs)` over a `body` GraphModule holding the region's nodes.
The body has no parameters of its own: the modules and parameters it uses are passed in as
arguments, read in the outer graph by get_attr under their original names, so parameter names and
the pipeline split are unchanged. Recomputation is non-reentrant (use_reentrant=False), keeps the
RNG state, and is numerically exact; collectives it runs again are counted as repeated traffic.
"""
from __future__ import annotations

import operator
from typing import Collection, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from passes.rewrite.sharding import LAYER, is_attention, nodes_by_layer, tag_layers
from runtime.context.ring_attention import ring_attention
from runtime.pipeline.split_backward import RECOMPUTED
from runtime.comm import collectives
from runtime.comm import instrument
from runtime.training import rng


def recompute(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]],
              full: Collection[str] = (), selective: Collection[str] = ()) -> fx.GraphModule:
    """Checkpoint the whole of each layer in `full` and the attention core of each in `selective`."""
    tag_layers(gm, layers)
    both = set(full) & set(selective)
    if both:
        raise ValueError(f"layers {sorted(both)} ask for both full and selective recompute")
    for layer, nodes in nodes_by_layer(gm, set(full) | set(selective)).items():
        slug = layer.replace(".", "_")
        if layer in full:
            region = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
            checkpoint_region(gm, region, f"recompute_full_{slug}", layer)
            continue
        cores = attention_cores(gm, nodes)
        if not cores:
            raise ValueError(f"layer {layer}: selective recompute found no attention to recompute")
        for i, core in enumerate(cores):
            checkpoint_region(gm, core, f"recompute_sel_{slug}" + (f"_{i}" if i else ""), layer)
    gm.graph.lint()
    gm.recompile()
    return gm


def _square(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 3 and val.shape[-1] == val.shape[-2] > 1


_SOFTMAX = {F.softmax, torch.softmax, "softmax", torch.ops.aten._softmax.default,
            torch.ops.aten.softmax.int, torch.ops.aten._safe_softmax.default}


def _is_softmax(gm, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), nn.Softmax)
    return node.op in ("call_function", "call_method") and node.target in _SOFTMAX


def attention_cores(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """Each attention of a layer as nodes in graph order: an sdpa (or sink attention) call; or a
    softmax over scores [..., s, s] with the score nodes before it (q @ kᵀ, scale, mask), the
    [..., s, s] nodes after it (dropout) and the ones that leave that shape (att @ v)."""
    mine, order = set(nodes), {n: i for i, n in enumerate(nodes)}
    cores = []
    for node in nodes:
        if is_attention(node) or node.target is ring_attention:
            cores.append([node])
        elif _is_softmax(gm, node) and _square(node):
            region, stack = {node}, list(node.all_input_nodes)
            while stack:  # the scores, back to the first value that is not [..., s, s]
                arg = stack.pop()
                if arg in mine and arg not in region and _square(arg) and arg.op != "get_attr":
                    region.add(arg)
                    stack.extend(arg.all_input_nodes)
            stack = list(node.users)
            while stack:  # forward through [..., s, s] values to the first that leaves the shape
                user = stack.pop()
                if user in mine and user not in region:
                    region.add(user)
                    stack.extend(user.users if _square(user) else ())
            cores.append(sorted(_convex(region, mine), key=order.__getitem__))
    return cores


def _convex(region: set[fx.Node], mine: set[fx.Node]) -> set[fx.Node]:
    """Add the nodes on paths between two region nodes (the mask sized by scores.size(-1), say),
    so that the region can become one call."""
    def reach(step) -> set[fx.Node]:
        seen, stack = set(), [m for n in region for m in step(n)]
        while stack:
            node = stack.pop()
            if node in mine and node not in seen:
                seen.add(node)
                stack.extend(step(node))
        return seen
    return region | (reach(lambda n: n.users) & reach(lambda n: n.all_input_nodes))


def invoke(module: nn.Module, *args, **kwargs):
    """A module call inside a recompute body (the module is an argument of the body)."""
    return module(*args, **kwargs)


class _Recomputing:
    """Re-enterable, like collectives.recomputing: a recomputation counted as repeated traffic,
    drawing the tensor-parallel dropout masks its forward drew."""

    def __init__(self, replay: rng.StreamReplay):
        self.counting, self.replay = collectives.recomputing(), replay.recompute()

    def __enter__(self):
        self.counting.__enter__()
        self.replay.__enter__()

    def __exit__(self, *exc):
        self.replay.__exit__(*exc)
        self.counting.__exit__(*exc)


def _recompute_contexts():
    # the tensor-parallel dropout stream replays like the default generator, which checkpoint
    # itself restores: a recomputed region draws the masks its forward drew
    replay = rng.StreamReplay()
    return replay.forward(), _Recomputing(replay)


def checkpointed(body: nn.Module, *args):
    """body(*args) under non-reentrant activation checkpointing (plain call without autograd)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not torch.is_grad_enabled() or any(collectives._fake(t) for t in tensors):
        return body(*args)
    instrument.note_kept(tensors)  # checkpoint holds its inputs until backward
    return checkpoint(body, *args, use_reentrant=False, context_fn=_recompute_contexts)


def checkpoint_region(gm: fx.GraphModule, region: list[fx.Node], name: str, layer: str) -> fx.Node:
    """Replace `region` (nodes in graph order) by one checkpointed call_module node `name`."""
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    modules = list(dict.fromkeys(n.target for n in region if n.op == "call_module"))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    body = _body(region, inputs, modules, outputs)
    gm.add_submodule(name, _shell(body, [p.name for p in body.graph.nodes if p.op == "placeholder"],
                                  name))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchor = max(inputs, key=order.__getitem__, default=None) or region[0].prev
    users = [u for o in outputs for u in o.users if u not in inside]
    if any(order[u] <= order[anchor] for u in users):
        raise ValueError(f"layer {layer}: the recompute region {name} is interleaved with its "
                         f"users")
    graph = gm.graph
    with graph.inserting_before(anchor.next):
        attrs = [graph.get_attr(m) for m in modules]
        call = graph.call_module(name, (*inputs, *attrs))
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for new in (*attrs, call):
        new.meta[LAYER] = layer
    for out, result in zip(outputs, results):
        result.meta = dict(out.meta)
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for node in reversed(region):
        graph.erase_node(node)
    return call


def _body(region, inputs, modules, outputs) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    held = {m: graph.placeholder(m.replace(".", "_")) for m in modules}
    for node in region:
        if node.op == "call_module":
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = graph.call_function(invoke, (held[node.target], *args), kwargs)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta = dict(node.meta)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(nn.Module(), graph, "Body")


def _shell(body: fx.GraphModule, names: list[str], name: str) -> fx.GraphModule:
    """A GraphModule `checkpointed(self.body, *args)`: prints readably, body included."""
    root = nn.Module()
    root.body = body
    graph = fx.Graph()
    args = [graph.placeholder(n) for n in names]
    graph.output(graph.call_function(checkpointed, (graph.get_attr("body"), *args)))
    shell = fx.GraphModule(root, graph, "".join(p.title() for p in name.split("_")))
    setattr(shell, RECOMPUTED, True)  # what the executor's split backward looks for
    return shell
