"""What one rank runs of a pipeline: a stage program and the specs of the tensors crossing its
boundaries. The passes build them (passes.stages.pipeline_split); the executor runs them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point


@dataclass
class StageProgram:
    stage: int
    gm: fx.GraphModule
    data_inputs: tuple[str, ...]        # model placeholders this stage reads
    boundary_inputs: tuple[str, ...]    # values received from stage - 1
    outputs: tuple[str, ...]            # values sent to stage + 1 (the loss on the last stage)
    input_specs: tuple[TensorSpec, ...]   # of boundary_inputs, at the micro-batch shape captured
    output_specs: tuple[TensorSpec, ...]  # of outputs (empty on the last stage)
    shared_params: tuple[str, ...] = ()   # of the whole model: read by several stages (tied)
    loss_counts: tuple = ()               # runtime.training.loss_tokens.LossCount of its losses

    @property
    def is_last(self) -> bool:
        return not self.outputs or self.outputs == ("__loss__",)
