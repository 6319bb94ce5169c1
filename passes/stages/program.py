"""From a captured graph and a layout to the programs one rank runs.

`rewrite` applies the rewrite passes for this rank's tensor-parallel index, always in this order,
each reading what the previous ones left in the graph:

     token_mean         a mean cross-entropy divides by the step's targets, which the trainer
                        counts with the graph's own nodes (read before 5, at local shapes)
  0. expert_parallel    ep > 1: each rank keeps E/ep experts of every MoE layer (first; it changes
                        no shape, only the stacked expert weights and the moe_ffn call's ep)
  1. vocab_parallel     "embed"/"head" layers with tp: vocabulary-sharded embedding and loss
  2. tensor_parallel    block layers with tp: column/row-parallel linears, tp_copy / tp_all_reduce
  3. sequence_parallel  layers with sp: those collectives become sequence all-gather /
                        reduce-scatter, and resharding nodes go where an SP layer meets a non-SP one
  4. context_parallel   cp > 1: every attention becomes ring attention over the cp group and
                        position tables are read at this rank's global token positions
  5. recompute          layers with full / sel: the layer, or its attention core, checkpointed
                        (last, so a checkpointed region holds the collectives of 1-4 and runs them
                        again when it recomputes)

Every pass tags the nodes it inserts with their layer (node.meta["fxpar_layer"]); shapes are
propagated once, after the sharding passes 0-4 and before recompute (which only moves nodes into
checkpointed regions, where the literal sizes of views - a captured graph's concrete shapes - could
no longer be rewritten), so node.meta["val"] holds local shapes and the pipeline split that follows
places every node by its layer and records the local shapes crossing stages.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch.fx as fx

from passes.capture.trace import Captured
from passes.rewrite.context_parallel import context_parallel, local_inputs
from passes.rewrite.expert_parallel import expert_parallel, read_replicated
from passes.stages.pipeline_split import split_stages
from passes.rewrite.recompute import recompute
from passes.rewrite.sequence_parallel import sequence_parallel
from passes.rewrite.sharding import LAYER, localize_shapes, tag_layers
from passes.rewrite.tensor_parallel import tensor_parallel
from passes.rewrite.token_mean import loss_counts, token_mean
from passes.rewrite.vocab_parallel import vocab_parallel
from runtime.observe.measure import balanced_stage_sizes
from runtime.comm.mesh import RankGroups
from runtime.pipeline.schedule import Schedule
from runtime.programs.stage import StageProgram
from runtime.training.trainer import PipelineTrainer, TrainOptions

LOSS_COUNTS = "fxpar_loss_counts"   # gm.meta: the rewritten losses' counters (passes.rewrite.token_mean)


@dataclass(frozen=True)
class Layout:
    """Plain description of the rewrite: each layer's strategy text (cost_model.layers.strategy form,
    e.g. "tp+sp+sel"; layers not listed are "none"), contiguous layer counts per stage, whether
    a vocabulary that tp does not divide may be padded, and the context-parallel size (every
    layer's sequence is split cp ways; cp is a property of the mesh, not of one layer)."""

    tp: int
    strategies: tuple[tuple[str, str], ...]   # (layer name, strategy text)
    stage_sizes: tuple[int, ...]              # in layer order; len = number of stages
    pad_vocab: bool = False
    cp: int = 1
    ep: int = 1                               # expert-parallel size (passes.rewrite.expert_parallel)

    def __post_init__(self):
        for layer, text in self.strategies:
            parts = set(text.split("+"))
            if "sp" in parts and "tp" not in parts:
                raise ValueError(f"layer {layer}: sequence parallel (sp) requires tp, got {text!r}")
            if {"sel", "full"} <= parts:
                raise ValueError(f"layer {layer}: choose one of sel and full, got {text!r}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_sizes)

    def layers_with(self, part: str) -> frozenset[str]:
        """Layers whose strategy includes `part` ("tp", "sp", "sel", "full")."""
        return frozenset(layer for layer, text in self.strategies if part in text.split("+"))


def rewrite(captured: Captured, layout: Layout, tp_rank: int, cp_rank: int = 0,
            ep_rank: int = 0) -> fx.GraphModule:
    """Apply the rewrite passes of `layout` to captured.gm for tp index `tp_rank`, cp index
    `cp_rank` and expert-parallel index `ep_rank`; in place."""
    gm = captured.gm
    layers = {layer.name: layer.nodes for layer in captured.layers}
    tag_layers(gm, layers)
    token_mean(gm)
    if layout.ep > 1:  # cuts expert weights only: no shape in the graph changes
        expert_parallel(gm, layout.ep, ep_rank)
    ends = {layer.name for layer in captured.layers if layer.kind != "block"}
    tp_layers = layout.layers_with("tp")
    vocab_parallel(gm, {name: layers[name] for name in sorted(tp_layers & ends)}, layout.tp,
                   tp_rank, pad=layout.pad_vocab, localize=False)
    tensor_parallel(gm, {name: layers[name] for name in sorted(tp_layers - ends)}, layout.tp,
                    tp_rank, localize=False)
    read_replicated(gm)  # MoE nodes are replicated over tp: not behind a tp_copy
    sequence_parallel(gm, layers, layout.layers_with("sp") & tp_layers, layout.tp, localize=False,
                      cp=layout.cp)
    context_parallel(gm, layers, layout.cp, cp_rank, localize=False)
    if (layout.tp > 1 and tp_layers) or layout.cp > 1:  # one shape propagation for all of them
        localize_shapes(gm, local_inputs(gm, layout.cp))
    gm.meta[LOSS_COUNTS] = loss_counts(gm)  # what leads to each count, not yet checkpointed
    # Last, on local shapes: the literal sizes of views inside a checkpointed region (BLOOM's
    # [batch x heads, seq, seq] scores) are rewritten before the region hides them.
    recompute(gm, layers, full=layout.layers_with("full"), selective=layout.layers_with("sel"))
    return gm


def rank_programs(captured: Captured, layout: Layout, tp_rank: int,
                  stages: tuple[int, ...], cp_rank: int = 0,
                  ep_rank: int = 0) -> dict[int, StageProgram]:
    """The stage programs for `stages` on the rank with tensor-parallel index `tp_rank`,
    context-parallel index `cp_rank` and expert-parallel index `ep_rank`."""
    gm = rewrite(captured, layout, tp_rank, cp_rank, ep_rank)
    order = [layer.name for layer in captured.layers]
    if sum(layout.stage_sizes) != len(order) or min(layout.stage_sizes) < 1:
        raise ValueError(f"stage sizes {layout.stage_sizes} do not cover {len(order)} layers")
    stage_of_layer, first = {}, 0
    for stage, size in enumerate(layout.stage_sizes):
        stage_of_layer.update(dict.fromkeys(order[first:first + size], stage))
        first += size
    node_stage, previous = {}, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = node.meta.get(LAYER)
        if layer in stage_of_layer:
            node_stage[node.name] = stage_of_layer[layer]
        else:  # untagged: with the node it reads, else the one before it
            source = next(iter(node.all_input_nodes), previous)
            node_stage[node.name] = node_stage[source.name]
        previous = node
    programs = split_stages(gm, node_stage, layout.num_stages)
    for count in gm.meta[LOSS_COUNTS]:
        stage = next(s for s, p in enumerate(programs) if hasattr(p.gm, count.buffer))
        programs[stage].loss_counts += (replace(count, stage=stage),)
    return {s: programs[s] for s in stages}


def build_pipeline_trainer(captured: Captured, schedule: Schedule, groups: RankGroups,
                           optimizer: Callable, options: TrainOptions = TrainOptions(),
                           stage_sizes: tuple[int, ...] | None = None) -> PipelineTrainer:
    """A trainer for this rank's stages of `schedule` (stage s on pipeline rank s % p). With
    tp > 1 every block is tensor-parallel. `captured` is rewritten in place and its parameters
    are trained: pass a fresh capture or a deep copy per trainer."""
    sizes = stage_sizes or balanced_stage_sizes(len(captured.layers), schedule.num_stages)
    tp = groups.mesh.tp
    strategies = tuple((b.name, "tp") for b in captured.blocks) if tp > 1 else ()
    programs = rank_programs(captured, Layout(tp, strategies, sizes), groups.tp_index,
                             schedule.stages_of(groups.pp_index))
    return PipelineTrainer(programs, schedule, groups, captured.input_names, optimizer,
                           options=options, tied=captured.tied)
