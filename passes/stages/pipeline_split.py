"""Split a graph into per-stage programs at layer boundaries.

Stage s's program takes the values that cross into it from stage s-1 (boundary inputs) plus the
model inputs it reads itself (data inputs, fed from the batch), and returns the values that later
stages need — including values only passing through it, so a stage only ever talks to its
neighbours. The last stage returns the model's output (the loss).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.fx as fx

from runtime.programs.stage import StageProgram, TensorSpec


def split_stages(gm: fx.GraphModule, node_stage: Mapping[str, int], num_stages: int
                 ) -> list[StageProgram]:
    """`node_stage` maps every node name (except placeholders and output) to its stage."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    missing = [n.name for n in nodes if n.name not in node_stage]
    if missing:
        raise ValueError(f"nodes without a stage: {missing[:5]}")
    crossing = _crossing_values(gm, node_stage, num_stages)
    shared = _shared_params(gm, node_stage, num_stages)
    return [_build_stage(gm, s, node_stage, crossing, num_stages, shared)
            for s in range(num_stages)]


def split_stage(gm: fx.GraphModule, node_stage: Mapping[str, int], num_stages: int,
                stage: int) -> StageProgram:
    """Stage `stage`'s program of split_stages alone: building the others costs time
    proportional to the whole graph (profiling one layer of a 61-block model would build the
    60 others twice)."""
    crossing = _crossing_values(gm, node_stage, num_stages)
    shared = _shared_params(gm, node_stage, num_stages)
    return _build_stage(gm, stage, node_stage, crossing, num_stages, shared)


def _stage_of_use(user: fx.Node, node_stage: Mapping[str, int], num_stages: int) -> int:
    return num_stages - 1 if user.op == "output" else node_stage[user.name]


def _uses(node: fx.Node, node_stage, num_stages) -> set[int]:
    return {_stage_of_use(u, node_stage, num_stages) for u in node.users}


def _shared_params(gm, node_stage, num_stages) -> tuple[str, ...]:
    """Names of parameters that more than one stage reads (through get_attr or a module, e.g. a
    head computing F.linear(x, wte.weight)): each such stage holds its own copy, which the runtime
    keeps one parameter (runtime.training.tied), rather than receiving the weight with every micro-batch."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    stages: dict[int, set[int]] = {}
    names: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in params:
            read = {(str(node.target), params[str(node.target)])}
            where = _uses(node, node_stage, num_stages)
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            read = {(f"{node.target}.{n}", p) for n, p in module.named_parameters()}
            where = {node_stage[node.name]}
        else:
            continue
        for name, param in read:
            stages.setdefault(id(param), set()).update(where)
            names.setdefault(id(param), name)
    return tuple(sorted(names[i] for i, where in stages.items() if len(where) > 1))


def _crossing_values(gm, node_stage, num_stages) -> list[list[fx.Node]]:
    """crossing[s] = values made at or before stage s and used after it (sent s -> s+1).
    Weights and buffers (get_attr) never cross: every stage that reads one reads its own."""
    crossing: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        last_use = max((_stage_of_use(u, node_stage, num_stages) for u in node.users), default=0)
        for s in range(node_stage[node.name], last_use):
            crossing[s].append(node)
    return crossing


def _build_stage(gm, stage, node_stage, crossing, num_stages, shared) -> StageProgram:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    received = crossing[stage - 1] if stage > 0 else []
    for node in received:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    data_inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and any(
                _stage_of_use(u, node_stage, num_stages) == stage for u in node.users):
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
            data_inputs.append(node.name)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            read_here = stage in _uses(node, node_stage, num_stages)
            if read_here or (not node.users and node_stage[node.name] == stage):
                env[node] = graph.node_copy(node, lambda arg: env[arg])
        elif node.op not in ("placeholder", "output") and node_stage[node.name] == stage:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    if stage == num_stages - 1:
        (result,) = [n for n in gm.graph.nodes if n.op == "output"]
        graph.output(fx.node.map_arg(result.args[0], lambda arg: env[arg]))
        outputs, out_specs = ("__loss__",), ()
    else:
        sent = crossing[stage]
        graph.output(tuple(env[n] for n in sent))
        outputs = tuple(n.name for n in sent)
        out_specs = tuple(_spec(n) for n in sent)
    program = fx.GraphModule(gm, graph, f"Stage{stage}")
    specs = tuple(_spec(n) for n in received)
    return StageProgram(stage, program, tuple(data_inputs), tuple(n.name for n in received),
                        outputs, specs, out_specs, shared)


def _spec(node: fx.Node) -> TensorSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"value {node.name} crossing a stage boundary is not a tensor")
    return TensorSpec(tuple(val.shape), val.dtype)


def stage_assignment(layer_nodes: Mapping[str, tuple[str, ...]], layer_order: list[str],
                     stage_sizes: list[int]) -> dict[str, int]:
    """Node -> stage from contiguous layer counts per stage (e.g. [3, 2, 2, 3])."""
    if sum(stage_sizes) != len(layer_order) or min(stage_sizes) < 1:
        raise ValueError(f"stage sizes {stage_sizes} do not cover {len(layer_order)} layers")
    result, position = {}, 0
    for stage, size in enumerate(stage_sizes):
        for layer in layer_order[position:position + size]:
            result.update({n: stage for n in layer_nodes[layer]})
        position += size
    return result
