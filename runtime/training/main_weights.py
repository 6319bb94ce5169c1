"""Mixed precision with fp32 main weights (TrainOptions.precision="bf16-main").

The model's weights, gradients and activations are bf16; the optimizer updates an fp32 main copy
of every weight it steps and writes it back rounded: mixed-precision Adam as ZeRO counts it
(Rajbhandari et al. 2020, section 3.1), 2 bytes of weight, 2 of gradient, and 12 of optimizer
state (the fp32 main copy and Adam's two fp32 moments) per parameter, which is what the planner
prices for a 16-bit model (cost_model.layers.memory). (Megatron-LM's `--bf16` keeps the same
main copy, with its gradients accumulated in fp32 rather than bf16.) Autocast over fp32 weights (the
"bf16" precision) keeps 4 + 4 + 8 and, per micro-batch in flight, the bf16 copies of the weights
its matmuls saved, beside fp32 activations of the ops it leaves in fp32.

The main copy lives in the optimizer's own state, under MAIN_KEY beside Adam's moments, so that
a checkpoint (runtime.checkpoint.state: optimizer states shaped like their parameter) saves and
restores it, and every parameter keeps its identity: sharded data parallel's flat shards, the
decay masks keyed by them and checkpoints name the same tensors as under fp32.
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["COMPUTE_DTYPE", "MAIN_KEY", "compute_inputs", "step_on_main"]

COMPUTE_DTYPE = torch.bfloat16
MAIN_KEY = "main"


def compute_inputs(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Floating inputs (images, noise, regression targets) in the compute dtype; token ids and
    masks as they are."""
    return tuple(t.to(COMPUTE_DTYPE) if t.is_floating_point() else t for t in tensors)


@torch.no_grad()
def step_on_main(optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on the fp32 main copies: each stepped parameter holds its main copy
    and an fp32 gradient for the step (the optimizer's states are made and kept in fp32), then
    gets back its bf16 storage with the updated values rounded into it. A parameter's first
    step makes its main copy from its bf16 values."""
    swapped = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.dtype == torch.float32:
                continue
            main = optimizer.state[p].get(MAIN_KEY)
            if main is None:   # kept in the state after the step: optimizers make theirs
                main = p.detach().float()   # when they find it empty
            low, grad = p.data, p.grad
            p.grad = None
            p.data = main
            p.grad = grad.float()
            swapped.append((p, low, grad))
    try:
        optimizer.step()
    finally:
        for p, low, grad in swapped:
            main = optimizer.state[p][MAIN_KEY] = p.data
            p.grad = None
            p.data = low
            low.copy_(main)
            p.grad = grad
