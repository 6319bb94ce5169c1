"""Index tables a rewrite adds to a graph (context parallelism's token positions, the kv heads a
tensor-parallel rank selects), on the device of the model's weights.

On the meta device a tensor keeps no values, so a table made there would be lost; `table` keeps
its values beside it (`fxpar_value`), and a model materialised per shard (planner.weights.materialize)
gives them back to the table on the device it trains on.
"""
from __future__ import annotations

import torch

VALUE = "fxpar_value"


def table(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`values` (computed on the CPU) on `device`; on meta, with the values kept beside it."""
    placed = values.to(device)
    if placed.is_meta:
        setattr(placed, VALUE, values.detach().clone())
    return placed
