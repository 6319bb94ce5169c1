"""What fxpar's wrappers of transformers models share: transformers itself (or an error naming
the extra to install) and their shell, the wrapped model under `model` (so parameter names are
transformers' own behind "model.") and the plan's name for it."""
from __future__ import annotations

import torch


class HFWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def fxpar_name(self) -> str:
        return type(self.model).__name__


def transformers_module():
    """The transformers package, imported on first use: planning presets never needs it."""
    try:
        import transformers
    except ImportError as err:
        raise RuntimeError("Hugging Face models need the optional extra: "
                           "pip install 'fxpar[hf]'") from err
    return transformers
