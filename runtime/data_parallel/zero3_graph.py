"""The stage-program edits of ZeRO-3 (runtime.data_parallel.sharded_dp, level 3): which layer (unit) owns each
parameter, where in a stage program a unit's parameters are first and last read, and the calls
inserted there that gather a unit's parameters before that span and free them after it; a
checkpointed region's body is wrapped so that the backward's recomputation gathers it again.

The inserted calls find their ShardedDP by the key it was registered under (`register`).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

LAYER = "fxpar_layer"  # the node meta key the rewrite passes tag every node with
# key -> runtime.data_parallel.sharded_dp.ShardedDP (not imported: sharded_dp imports this module)
_REGISTRY: dict[str, object] = {}


def register(key: str, sharded) -> None:
    """The ShardedDP that the calls `insert_gathers` put in with `key` act on."""
    _REGISTRY[key] = sharded


def zero3_gather(key: str, stage: int, unit: str) -> None:
    """Called by a stage program before the first node of `unit` (level 3)."""
    _REGISTRY[key].gather_unit(stage, unit)


def zero3_free(key: str, stage: int, unit: str) -> None:
    """Called by a stage program after the last node of `unit` (level 3)."""
    _REGISTRY[key].free_unit(stage, unit)


def param_units(gm: fx.GraphModule) -> dict[str, str]:
    """Parameter name -> the one layer whose nodes read it (get_attr or call_module); a
    parameter several layers read has no unit (it stays whole)."""
    readers: dict[str, set] = defaultdict(set)
    params = dict(gm.named_parameters())
    for node in gm.graph.nodes:
        layer = node.meta.get(LAYER)
        if node.op == "get_attr":
            names = [node.target] if node.target in params else [
                f"{node.target}.{n}" for n, _ in _submodule_params(gm, node.target)]
        elif node.op == "call_module":
            names = [f"{node.target}.{n}" for n, _ in _submodule_params(gm, node.target)]
        else:
            continue
        for name in names:
            readers[name].add(layer)
    return {name: next(iter(ls)) for name, ls in readers.items()
            if len(ls) == 1 and None not in ls}


def _submodule_params(gm, target):
    try:
        module = gm.get_submodule(target)
    except AttributeError:
        return []
    return list(module.named_parameters()) if isinstance(module, torch.nn.Module) else []


def _unit_spans(gm: fx.GraphModule) -> dict[str, tuple[fx.Node, fx.Node]]:
    """Layer -> (first, last) node reading its parameters: a call_module of its modules, or a
    get_attr of its parameters and the nodes using what it fetched (where the data is read)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    spans: dict[str, list] = {}
    for node in gm.graph.nodes:
        layer = node.meta.get(LAYER)
        if layer is None or node.op not in ("get_attr", "call_module"):
            continue
        if node.op == "get_attr" and not _submodule_params(gm, node.target) and \
                node.target not in dict(gm.named_parameters()):
            continue  # a buffer or a constant
        users = [node, *_readers(node)] if node.op == "get_attr" else [node]
        span = spans.setdefault(layer, [node, node])
        span[0] = min(span[0], node, key=order.get)
        span[1] = max([span[1], *users], key=order.get)
    return {layer: (a, b) for layer, (a, b) in spans.items()}


# ops whose output may be a view of their input: the parameter's data is read where their users
# run (tp_grad_sum of a replicated scale is the scale itself forward, a .t() its transpose)
_ALIASING = frozenset({
    "view", "view_as", "reshape", "reshape_as", "_unsafe_view", "transpose", "t", "permute",
    "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim", "narrow",
    "select", "slice", "getitem", "getattr", "split", "chunk", "unbind", "contiguous", "to",
    "type_as", "float", "detach", "alias", "as_strided", "tp_grad_sum", "tp_copy",
    "tp_grad_share"})


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read `node`'s data: its users and, through ops that may return a view of
    it, theirs."""
    found, stack = {}, list(node.users)
    while stack:
        user = stack.pop()
        if user not in found:
            found[user] = None
            if _name(user) in _ALIASING:
                stack.extend(user.users)
    return list(found)


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    target = getattr(node.target, "overloadpacket", node.target)
    return getattr(target, "__name__", "")


def unit_order(gm: fx.GraphModule) -> list[str]:
    """Layers in the order the forward first reads their parameters."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    spans = _unit_spans(gm)
    return sorted(spans, key=lambda layer: order[spans[layer][0]])


class _Regathering(torch.nn.Module):
    """A checkpointed region's body that gathers its unit first: when the backward recomputes
    the region, the unit's parameters may have been freed since the forward."""

    def __init__(self, body: torch.nn.Module, key: str, stage: int, unit: str):
        super().__init__()
        self.body, self.key, self.stage, self.unit = body, key, stage, unit

    def forward(self, *args):
        sharded = _REGISTRY[self.key]
        if torch.is_grad_enabled() and not all(
                b.gathered for b in sharded.by_stage[self.stage]
                if b.unit == f"{self.stage}:{self.unit}"):
            sharded.backward_gather(self.stage, self.unit)
        return self.body(*args)


def regather_recomputed(gm: fx.GraphModule, key: str, stage: int, units: set[str]) -> None:
    """Wrap the body of every checkpointed region (passes.rewrite.recompute's call_module shells, which
    hold it as `.body`) of a level-3 unit in _Regathering."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.meta.get(LAYER) not in units:
            continue
        shell = gm.get_submodule(node.target)
        if isinstance(getattr(shell, "body", None), torch.nn.Module) and \
                not isinstance(shell.body, _Regathering):
            shell.body = _Regathering(shell.body, key, stage, node.meta[LAYER])


def insert_gathers(gm: fx.GraphModule, key: str, stage: int, units: list[str]) -> None:
    """Before the first node reading a unit's parameters, a call gathering them; after the
    last, one freeing them. Both are tagged with the unit's layer."""
    spans = _unit_spans(gm)
    first = {unit: spans[unit][0] for unit in units}
    last = {unit: spans[unit][1] for unit in units}
    for unit in units:
        with gm.graph.inserting_before(first[unit]):
            gm.graph.call_function(zero3_gather, (key, stage, unit)).meta[LAYER] = unit
        with gm.graph.inserting_after(last[unit]):
            gm.graph.call_function(zero3_free, (key, stage, unit)).meta[LAYER] = unit
    gm.recompile()
