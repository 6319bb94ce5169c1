"""From a captured graph and a layout to the programs one rank runs: tensor-parallel rewrite of the
chosen layers for this rank's tp index, then the pipeline split, keeping this rank's stages."""
from __future__ import annotations

from dataclasses import dataclass

from passes.capture import Captured
from passes.pipeline_split import StageProgram, split_stages, stage_assignment
from passes.tensor_parallel import tensor_parallel


@dataclass(frozen=True)
class Layout:
    """Plain description of the rewrite: each layer's strategy text (cost_model.strategy form,
    e.g. "tp+sp+sel"; layers not listed are "none"), and contiguous layer counts per stage."""

    tp: int
    strategies: tuple[tuple[str, str], ...]   # (layer name, strategy text)
    stage_sizes: tuple[int, ...]              # in layer order; len = number of stages

    @property
    def num_stages(self) -> int:
        return len(self.stage_sizes)

    def layers_with(self, part: str) -> frozenset[str]:
        """Layers whose strategy includes `part` ("tp", "sp", "sel", "full")."""
        return frozenset(layer for layer, text in self.strategies if part in text.split("+"))


def rank_programs(captured: Captured, layout: Layout, tp_rank: int,
                  stages: tuple[int, ...]) -> dict[int, StageProgram]:
    """The stage programs for `stages` on the rank with tensor-parallel index `tp_rank`."""
    gm = captured.gm
    layer_nodes = {layer.name: layer.nodes for layer in captured.layers}
    tensor_parallel(gm, {name: layer_nodes[name] for name in sorted(layout.layers_with("tp"))},
                    layout.tp, tp_rank)
    # The rewrite added collective and bias nodes: they belong to the layer of the node they follow.
    node_stage = stage_assignment(layer_nodes, [l.name for l in captured.layers],
                                  list(layout.stage_sizes))
    previous = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.name not in node_stage:
            source = next(iter(node.all_input_nodes), previous)
            node_stage[node.name] = node_stage[source.name]
        previous = node
    programs = split_stages(gm, node_stage, layout.num_stages)
    return {s: programs[s] for s in stages}
