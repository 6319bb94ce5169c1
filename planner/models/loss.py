"""`loss_fn=`: train a model whose forward returns logits (or any output) rather than the loss.

fxpar captures the whole training computation, loss included, and back-propagates what the
captured forward returns, so that value must be the loss. `with_loss(model, loss_fn)` is the same
model (the same modules, parameters and names) whose forward takes the targets as its last input
and returns `loss_fn(model(*inputs), targets)`.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch


def with_loss(model, loss_fn: Callable | None):
    """`model` itself when loss_fn is None; else a view of it whose forward ends in loss_fn."""
    if loss_fn is None:
        return model
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"loss_fn= applies to a model given as an nn.Module, not to {model!r}: "
                         f"fxpar's own models return their loss")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, targets) -> scalar loss, got "
                        f"{type(loss_fn).__name__}")
    base = type(model)

    def forward(self, *inputs):
        if len(inputs) < 2:
            raise ValueError("with loss_fn=, the inputs end with the targets: "
                             "train_step(*model_inputs, targets)")
        return loss_fn(base.forward(self, *inputs[:-1]), inputs[-1])

    wrapped = copy.copy(model)  # shares modules and parameters: the same model, another forward
    wrapped.__class__ = type(f"{base.__name__}WithLoss", (base,), {"forward": forward})
    return wrapped


def causal_lm_loss(output, targets):
    """Mean cross-entropy of each position's logits against its target token (the next token),
    for a forward that returns logits, or an output with a `.logits` field (a Hugging Face
    `ModelOutput`, a dict): `autoparallelize(model, ..., loss_fn=causal_lm_loss)`."""
    logits = output
    if not isinstance(logits, torch.Tensor):
        logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"causal_lm_loss needs logits: a tensor, or an output with .logits; got "
                        f"{type(output).__name__}")
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
