"""What of a model's structure the plan does not follow, said in the plan, and the names of
the parts it does follow.

fxpar splits one chain of repeated blocks into pipeline stages and prices every block as a layer
of its own: the blocks of each part (a vision tower's, a decoder's; an encoder's, a decoder's:
passes.capture.trace), one part after the other. Everything else runs inside the embedding or
the head layer, or beside the block before it. A list of layers that is not a part - two towers
that run in alternation, a list of bare layers beside the blocks - runs there, whole, never spread
over stages, never tensor-parallel apart from its end layer. The plan says so, naming the lists."""
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
        if len(layers) >= 2 and len({type(m) for m in layers}) == 1 and all(
                _is_block(m) for m in layers):
            found.append((name, len(layers), type(layers[0]).__name__))
    return found


def _is_block(module: nn.Module) -> bool:
    """A block holds two or more modules with parameters (attention, an MLP, norms); a list of
    bare linears (a projector's MLP) is not a list of blocks."""
    return sum(1 for m in module.modules() if m is not module
               and any(True for _ in m.parameters(recurse=False))) >= 2


def _inside(name: str, prefix: str) -> bool:
    return bool(prefix) and name.startswith(prefix + ".")


def structure_notes(model: nn.Module, parts: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's notes on layer lists beside the blocks it splits (`parts`: the captured
    lists' names, passes.capture.trace.Captured.parts), and on lists holding one block several
    times."""
    notes = tuple(filter(None, (_repeated_note(model, part) for part in parts)))
    lists = [(n, k, t) for n, k, t in other_layer_lists(model, parts[0] if parts else "")
             if not any(n == p or p.startswith(n + ".") or _inside(n, p) for p in parts)]
    if not lists:
        return notes
    named = ", ".join(f"{name} ({count} x {kind})" for name, count, kind in lists)
    split = " and ".join(parts)
    return (f"only {split} {'is' if len(parts) == 1 else 'are'} split into blocks and stages; "
            f"{named} {'runs' if len(lists) == 1 else 'run'} whole inside the layer around "
            f"{'it' if len(lists) == 1 else 'them'} (the embedding, the head or the block "
            f"before), on its stage, and {'is' if len(lists) == 1 else 'are'} priced there",
            ) + notes


def _repeated_note(model: nn.Module, part: str) -> str:
    """A list that holds one block several times (ALBERT's shared layer): a module is captured
    under its first name, so every application of it is one layer."""
    try:  # children() names a module once; the list's own entries name every place
        blocks = [b for b in model.get_submodule(part)._modules.values() if b is not None]
    except AttributeError:
        return ""
    if len({id(b) for b in blocks}) == len(blocks):
        return ""
    return (f"{part} holds {len({id(b) for b in blocks})} distinct of its {len(blocks)} blocks "
            f"(one module listed several times shares its weights): each module's applications "
            f"are one layer, priced together, on one stage, under one strategy")



def carried_notes(captured) -> tuple[str, ...]:
    """The plan's notes, for a model of several parts, on values a layer makes that layers
    further on read, past the layer after it (an encoder's output every decoder block
    cross-attends to, a decoder's token embeddings made before the encoder's blocks): each is
    carried from its maker's stage to every stage holding a reader, sent along the stages between
    (planner.search.costs.ModelCosts.carried_bytes prices it). Values computed from no input and
    no parameter (position tables, masks) are not said."""
    from passes.capture.trace import CONSTANT, module_path
    if len(captured.parts) < 2:  # (a model of one part carries only what costs leaves unpriced)
        return ()
    order = {layer.name: i for i, layer in enumerate(captured.layers)}
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    readers: dict[tuple[str, str], list[str]] = {}
    for src, dst, edge in captured.layer_graph.edges(data=True):
        for name in edge["tensors"]:  # (a weight two layers read is read by each, not sent)
            if not nodes[name].meta.get(CONSTANT) and nodes[name].op != "get_attr":
                readers.setdefault((src, name), []).append(dst)
    notes = []
    for (src, name), dsts in readers.items():
        if max(order[d] for d in dsts) <= order[src] + 1:
            continue  # read by the next layer only: the stages' own boundary
        dsts.sort(key=order.get)
        val = nodes[name].meta.get("val")
        shape = f", {list(val.shape)} for one sample," if hasattr(val, "shape") else ""
        module = module_path(nodes[name])
        name = f"{name} (of {module}){shape}" if module else f"{name}{shape}"
        notes.append(f"{name} made in {src}, is read by {_span(dsts)}: carried from "
                     f"{src}'s stage to every stage holding {'them' if len(dsts) > 1 else 'it'} "
                     f"and priced as sent along the stages between")
    return tuple(notes)


def _span(names: list[str]) -> str:
    """'dec.0-1' for a run of one list's blocks, else the names (the first four)."""
    prefixes = {n.rsplit(".", 1)[0] for n in names}
    indices = [n.rsplit(".", 1)[-1] for n in names]
    if len(prefixes) == 1 and len(names) > 1 and all(i.isdigit() for i in indices):
        return f"{prefixes.pop()}.{indices[0]}-{indices[-1]}"
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
