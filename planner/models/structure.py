"""What of a model's structure the plan does not follow, said in the plan.

fxpar splits one chain of repeated blocks (the model's block list) into pipeline stages and
prices every block as a layer of its own; everything else runs inside the embedding or the head
layer, whole, on the first or last stage. A second list of layers - the decoder of an
encoder-decoder, a second tower - is planned that way too: never spread over stages, never
tensor-parallel apart from its end layer. The plan says so, naming the lists."""
from __future__ import annotations

import torch.nn as nn


def other_layer_lists(model: nn.Module, block_prefix: str) -> list[tuple[str, int, str]]:
    """(name, layers, their type) of the lists of two or more parameterised layers beside the
    block list, outside it and outside one another."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or name == block_prefix:
            continue
        if _inside(name, block_prefix) or any(_inside(name, other) for other, _, _ in found):
            continue
        layers = [m for m in module.children() if any(True for _ in m.parameters())]
        if len(layers) >= 2 and len({type(m) for m in layers}) == 1:
            found.append((name, len(layers), type(layers[0]).__name__))
    return found


def _inside(name: str, prefix: str) -> bool:
    return bool(prefix) and name.startswith(prefix + ".")


def structure_notes(model: nn.Module, block_prefix: str) -> tuple[str, ...]:
    """The plan's notes on layer lists beside the blocks it splits."""
    lists = [(n, k, t) for n, k, t in other_layer_lists(model, block_prefix)
             if not block_prefix.startswith(n + ".")]
    if not lists:
        return ()
    named = ", ".join(f"{name} ({count} x {kind})" for name, count, kind in lists)
    return (f"only {block_prefix} is split into blocks and stages; {named} "
            f"{'runs' if len(lists) == 1 else 'run'} inside the embedding or head layer, whole "
            f"on its stage and priced there (assumed: one chain of blocks)",)
