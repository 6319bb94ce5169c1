"""The optimizer `fxpar train` steps: AdamW (default) or SGD with momentum, with weight decay on
the weight matrices only — norm weights (every 1-D parameter that is not a bias), biases and
embeddings are left out unless [optimizer] decay_norms / decay_biases / decay_embeddings ask
for them. Two parameter groups always (decayed, not decayed; either may be empty), so that a
checkpoint's groups match under any plan."""
from __future__ import annotations

from typing import Iterable

import torch


def embedding_names(model: torch.nn.Module) -> set[str]:
    """Full names of the model's embedding tables (token, position): `<module>.weight`."""
    return {f"{name}.weight" if name else "weight" for name, module in model.named_modules()
            if isinstance(module, torch.nn.Embedding)}


def kind(name: str, param: torch.Tensor, embeddings: set[str]) -> str:
    """"embedding", "bias", "norm" or "weight" (only weights are always decayed)."""
    if name in embeddings:
        return "embedding"
    if name.rsplit(".", 1)[-1] == "bias" or name.endswith("_bias"):
        return "bias"
    if param.dim() < 2:
        return "norm"
    return "weight"


def decayed(name: str, param: torch.Tensor, embeddings: set[str], optimizer) -> bool:
    k = kind(name, param, embeddings)
    return (k == "weight" or (k == "norm" and optimizer.decay_norms)
            or (k == "bias" and optimizer.decay_biases)
            or (k == "embedding" and optimizer.decay_embeddings))


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]], embeddings: set[str],
                 optimizer) -> list[dict]:
    """[decayed, not decayed] parameter groups; `optimizer` is the config's [optimizer]."""
    decay, keep = [], []
    for name, param in named:
        (decay if decayed(name, param, embeddings, optimizer) else keep).append(param)
    return [{"params": decay, "weight_decay": optimizer.weight_decay},
            {"params": keep, "weight_decay": 0.0}]


def build(groups: list[dict] | list[torch.nn.Parameter], optimizer) -> torch.optim.Optimizer:
    """AdamW or SGD over `groups` (or a flat list of parameters: one decayed group, what
    sharded data parallel's flat shards get) with the config's hyperparameters."""
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": list(groups), "weight_decay": optimizer.weight_decay},
                  {"params": [], "weight_decay": 0.0}]
    if optimizer.name == "sgd":
        return torch.optim.SGD(groups, lr=optimizer.lr, momentum=optimizer.momentum)
    return torch.optim.AdamW(groups, lr=optimizer.lr, betas=tuple(optimizer.betas),
                             eps=optimizer.eps)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
