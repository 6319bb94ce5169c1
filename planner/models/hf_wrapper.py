"""The common shell of fxpar's wrappers of transformers models: the wrapped model under `model`
(so parameter names are transformers' own behind "model."), and the plan's name for it."""
from __future__ import annotations

import torch


class HFWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def fxpar_name(self) -> str:
        return type(self.model).__name__
