"""Cross-entropy losses divided by the whole step's count of targets, not each micro-batch's.

A cross-entropy of reduction "mean" divides by the targets that count in its own inputs (not
ignore_index; weighted by class weight). Run once per micro-batch and replica and averaged with
equal weights, that is the step's mean only when each micro-batch counts as many targets; padded
targets (ignore_index, as fine-tuning data marks padding and prompts) would make training silently
differ from one process. A "sum" would come out divided by the m·R the trainer averages over.
Each such loss becomes, in place (runtime.training.loss_tokens):

    summed = cross_entropy(logits, target, ..., reduction="sum")
    count  = count_targets(target, ignore_index, weight, mean)     # this micro-batch's
    loss   = per_token(summed, count, tokens)                      # tokens: a 0-d buffer

and `loss_counts` reads, from the rewritten graph at its local shapes, the nodes that lead to each
`count`: the trainer runs them on every micro-batch before a step to set `tokens`. Any other sum
over the batch that the loss adds up (passes.rewrite.sum_losses: `F.mse_loss(reduction="sum")`,
`err.sum()`) becomes per_token(sum, 1, tokens), the trainer's average undone as for a summed
cross-entropy.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from passes.rewrite.sharding import LAYER, ancestors
from passes.rewrite.sum_losses import sum_terms
from passes.rewrite.tables import table
from runtime.training.loss_tokens import LossCount, count_targets, per_token

aten = torch.ops.aten
CROSS_ENTROPY = {F.cross_entropy, aten.cross_entropy_loss.default}
_REDUCTIONS = ("none", "mean", "sum")  # aten's enum order
BUFFER = "fxpar_loss_tokens"


def cross_entropy_args(gm: fx.GraphModule, node: fx.Node) -> dict | None:
    """{logits, target, weight, ignore_index, reduction, label_smoothing} of a cross-entropy node
    (F.cross_entropy, aten's, nn.CrossEntropyLoss); None for any other node."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if not isinstance(module, nn.CrossEntropyLoss):
            return None
        weight = module.weight if module.weight is None else f"{node.target}.weight"
        return {"logits": node.args[0], "target": node.args[1], "weight": weight,
                "ignore_index": module.ignore_index, "reduction": module.reduction,
                "label_smoothing": module.label_smoothing}
    if not (node.op == "call_function" and node.target in CROSS_ENTROPY):
        return None
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    if node.target is F.cross_entropy:
        names = ("weight", "size_average", "ignore_index", "reduce", "reduction",
                 "label_smoothing")
    given = {**dict(zip(names, node.args[2:])), **node.kwargs}
    if given.get("size_average") is not None or given.get("reduce") is not None:
        raise ValueError(f"{node.name}: cross_entropy's size_average/reduce are deprecated and "
                         f"not supported; use reduction=")
    reduction = given.get("reduction", "mean")
    return {"logits": node.args[0], "target": node.args[1], "weight": given.get("weight"),
            "ignore_index": given.get("ignore_index", -100),
            "reduction": _REDUCTIONS[reduction] if isinstance(reduction, int) else reduction,
            "label_smoothing": given.get("label_smoothing", 0.0)}


def token_mean(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every mean or sum cross-entropy as described above, and read every other sum over
    the batch that the loss adds up (passes.rewrite.sum_losses) through per_token with a count
    of 1; in place."""
    found = [(node, args) for node in gm.graph.nodes
             for args in [cross_entropy_args(gm, node)] if args and args["reduction"] != "none"]
    sums = sum_terms(gm)
    for index, (node, args) in enumerate(found):
        _rewrite(gm, node, args, BUFFER + (f"_{index}" if index else ""))
    for index, node in enumerate(sums, len(found)):
        _undo_average(gm, node, BUFFER + (f"_{index}" if index else ""))
    if found or sums:
        gm.graph.lint()
        gm.recompile()
    return gm


def _add_buffer(gm: fx.GraphModule, buffer: str) -> None:
    """The 0-d buffer the trainer sets before each step (runtime.training.loss_tokens)."""
    device = next((t.device for t in gm.state_dict().values()), torch.device("cpu"))
    gm.register_buffer(buffer, table(torch.zeros(()), device), persistent=False)


def _rewrite(gm: fx.GraphModule, node: fx.Node, args: dict, buffer: str) -> None:
    _add_buffer(gm, buffer)
    graph = gm.graph
    with graph.inserting_before(node):
        weight = args["weight"]
        if isinstance(weight, str):
            weight = graph.get_attr(weight)
        extra = {"weight": weight} if weight is not None else {}
        if args["label_smoothing"]:
            extra["label_smoothing"] = args["label_smoothing"]
        summed = graph.call_function(F.cross_entropy, (args["logits"], args["target"]), {
            **extra, "ignore_index": args["ignore_index"], "reduction": "sum"})
        count = graph.call_function(count_targets, (args["target"], args["ignore_index"], weight,
                                                    args["reduction"] == "mean"))
        tokens = graph.get_attr(buffer)
        loss = graph.call_function(per_token, (summed, count, tokens))
    for new in (summed, count, tokens, loss):
        new.meta = {k: v for k, v in node.meta.items() if k in ("val", LAYER)}
    node.replace_all_uses_with(loss)
    graph.erase_node(node)


def _undo_average(gm: fx.GraphModule, node: fx.Node, buffer: str) -> None:
    """A sum over the batch (passes.rewrite.sum_losses), read through per_token with a count of
    1: the trainer then sets `buffer` to 1 / (m·R), undoing its average."""
    _add_buffer(gm, buffer)
    graph = gm.graph
    with graph.inserting_after(node):
        count = graph.call_function(count_targets, (node, -100, None, False))
    with graph.inserting_after(count):
        tokens = graph.get_attr(buffer)
    with graph.inserting_after(tokens):
        loss = graph.call_function(per_token, (node, count, tokens))
    for new in (count, tokens, loss):
        new.meta = {k: v for k, v in node.meta.items() if k in ("val", LAYER)}
    node.replace_all_uses_with(loss, delete_user_cb=lambda user: user is not loss and
                               user is not count)


def loss_counts(gm: fx.GraphModule) -> tuple[LossCount, ...]:
    """For each rewritten loss: its buffer and a graph of the nodes leading to its count, whose
    inputs are the graph's own (stage = -1: set by the pipeline split)."""
    counts = []
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target is per_token):
            continue
        count, buffer = node.args[1], node.args[2].target
        mean = count.args[3]
        counter, inputs = _counter(gm, count) if mean else (None, ())
        counts.append(LossCount(-1, buffer, counter, inputs))
    return tuple(counts)


def targets_from_modules(gm: fx.GraphModule) -> str | None:
    """Why the targets of a mean cross-entropy cannot be counted apart from the model (the
    trainer counts each micro-batch's from its inputs alone, `_counter`), or None. Asked at plan
    time too, so that such a model is refused there, not at its first step."""
    for node in gm.graph.nodes:
        args = cross_entropy_args(gm, node)
        if args is None or args["reduction"] != "mean" or not isinstance(args["target"], fx.Node):
            continue
        modules = [n.name for n in ancestors(args["target"]) if n.op == "call_module"]
        if modules:
            return (f"the targets of loss {node.name} are computed by modules "
                    f"({', '.join(sorted(modules))}), or from the size of their output "
                    f"(torch.arange(logits.shape[0])): pass them to the model as an input")
    return None


def _counter(gm: fx.GraphModule, count: fx.Node) -> tuple[fx.GraphModule, tuple[str, ...]]:
    needed = ancestors(count)
    modules = [n.name for n in needed if n.op == "call_module"]
    if modules:
        raise ValueError(f"the targets of loss {count.name} are computed by modules "
                         f"({', '.join(sorted(modules))}): pass them to the model as an input")
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[count])
    inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder" and n in needed)
    return fx.GraphModule(gm, graph, "LossCounter"), inputs
