"""What a layer's graph keeps for its backward, node by node: the saved tensors by the rules of
cost_model.ops.node_cost (followed back through collectives that pass their input through),
the attention core among them (what selective recomputation drops), the joins where a weight
meets the activations (what ZB-H1's recorded split backward keeps), and under autocast what
autocast saves instead (cost_model.layers.autocast_saved)."""
from __future__ import annotations

import torch
import torch.fx as fx

from cost_model.layers.autocast_saved import saved_bytes
from cost_model.ops import graph_facts as op_graph
from cost_model.ops.node_cost import node_cost, saved_node_name


def identity_forward(node: fx.Node) -> bool:
    """A collective that passes its input through unchanged in forward (tp_copy, tp_grad_sum): a
    tensor kept after it is the tensor kept before it, under the name of its source."""
    kind = getattr(node.target, "_fxpar_collective", "")
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    size = op_graph.total_bytes
    return (kind.endswith("_backward") and src is not None
            and size(node.meta.get("val")) == size(src.meta.get("val")))


def _canonical(name: str, nodes: dict[str, fx.Node], modules) -> str:
    """A saved entry's name, followed back through identity-forward collectives and views."""
    node_name, suffix = saved_node_name(name), name[len(saved_node_name(name)):]
    node = nodes.get(node_name)
    if node is None or not identity_forward(node):
        return name
    while identity_forward(node):
        node = op_graph.alias_root(node.args[0], modules)
    return node.name + suffix


def _saved_entries(sub: fx.GraphModule):
    """(canonical saved name, bytes) of every node, in graph order."""
    modules, nodes = dict(sub.named_modules()), {n.name: n for n in sub.graph.nodes}
    for node in sub.graph.nodes:
        for name, nbytes in node_cost(node, modules).saved:
            yield _canonical(name, nodes, modules), nbytes


def saved(sub: fx.GraphModule) -> dict[str, float]:
    """Saved-for-backward bytes by canonical saved name (cost_model.ops.node_cost's rules)."""
    return dict(_saved_entries(sub))


def core_nodes(sub: fx.GraphModule, seq: int) -> set[str]:
    """The attention core: the scores (an [..., s, s] product of two activations, QKᵀ) and every
    non-matmul op computed from them at their shape (scale, mask, softmax, dropout), stopping at
    the attention-over-values matmul. Found by structure, not by shape alone, so that a
    [b, s, h] tensor with h == s is never mistaken for scores."""
    modules = dict(sub.named_modules())
    core: set[str] = set()
    for node in sub.graph.nodes:
        val = node.meta.get("val")
        if not _square(val, seq) or node.op in ("placeholder", "get_attr", "output"):
            continue
        cost_class = node_cost(node, modules).op_class
        args = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if cost_class == "matmul":
            if len(args) >= 2 and all(op_graph.kind(a) == "activation" for a in args[:2]):
                core.add(node.name)
        elif any(a.name in core and a.meta["val"].shape == val.shape for a in args):
            core.add(node.name)
    return core


def _square(val, seq: int) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == val.shape[-2] == seq


def joins(sub: fx.GraphModule, modules: dict) -> list[fx.Node]:
    """The ops where a parameter's path meets the activations' (a linear, a norm's weight, a
    bias add): ZB-H1's I records the gradient arriving at each for W under split_backward
    "record" (runtime.pipeline.split_backward), one of its output's size."""
    return [n for n in sub.graph.nodes if n.op.startswith("call") and weighted(n, modules)
            and any(op_graph.kind(a) == "activation" for a in n.all_input_nodes)]


def weighted(node: fx.Node, modules: dict) -> bool:
    """Whether an op reads a parameter: a module's own, or an input made of parameters only."""
    if node.op == "call_module" and next(modules[node.target].parameters(), None) is not None:
        return True
    return any(op_graph.kind(a) == "param" for a in node.all_input_nodes)


def autocast_share(sub: fx.GraphModule, inputs: list[torch.Tensor], dtype: torch.dtype
                   ) -> tuple[float, float]:
    """(share, casts): the layer's saved-for-backward bytes under autocast to `dtype` but the
    weights' casts, per byte the rule-based count gives it (1.0 for a layer that saves
    nothing), and the bytes of the weights' casts it saves (cost_model.layers.autocast_saved)."""
    rule = sum(saved(sub).values())  # the captured shapes, which _extract keeps
    rest, casts = saved_bytes(sub, inputs, dtype)
    return (rest / rule if rule else 1.0), casts
