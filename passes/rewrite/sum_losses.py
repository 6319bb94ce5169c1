"""Losses that sum over the batch rather than average it, other than cross-entropy's.

The trainer averages the losses of a step's m micro-batches and R replicas with equal weights,
which is one process's loss over the whole batch when the loss is a mean. A loss that sums
(`F.mse_loss(..., reduction="sum")`, `nn.L1Loss(reduction="sum")`, `(out - y).pow(2).sum()`,
`0.5 * err.sum() / 64`) would come out divided by m·R, and so would its gradients: training
would differ from one process without an error. `sum_terms` finds every such term of the loss:
a loss function of reduction "sum" applied to the inputs' values, or a sum over every dimension
of a value that still holds the batch's dimension (followed from the inputs' dim 0 by
passes.rewrite.cp_tokens.follow_dim), from which the graph's output is reached only through sums,
differences, and products or quotients (as the dividend) with values not computed from the inputs.
passes.rewrite.token_mean reads each through per_token with a count of 1, as it does a sum
cross-entropy, so that the trainer's average is undone. One divided by a value computed from the
inputs (`x.sum() / x.shape[0]`, a mask's count) is a mean already, and left as it is; so is a sum
of values the batch was averaged or merged away from (a mixture of experts' balance loss sums
means over the tokens).
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn as nn

from passes.capture.trace import CONSTANT
from passes.rewrite.cp_tokens import follow_dim
from passes.rewrite.tp_views import op_name

_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "nll_loss",
           "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
           "soft_margin_loss", "poisson_nll_loss", "gaussian_nll_loss", "margin_ranking_loss",
           "hinge_embedding_loss", "cosine_embedding_loss", "multilabel_soft_margin_loss",
           "multi_margin_loss", "multilabel_margin_loss", "triplet_margin_loss"}
_LINEAR = {"add", "sub", "neg", "mul", "div", "truediv"}
_SUM = 2  # aten's reduction enum: none, mean, sum


def sum_terms(gm: fx.GraphModule) -> list[fx.Node]:
    """The sums over the batch that the loss adds up (module docstring)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [node for node in _sums(gm) if _summed_into(gm, node, output)]


def _sums(gm: fx.GraphModule) -> list[fx.Node]:
    """Loss functions of reduction "sum" and full sums of values holding the batch's dim."""
    first = next((n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"), None)
    batched = follow_dim(gm, 0, first.shape[0], lambda node, what: None) \
        if isinstance(first, torch.Tensor) and first.dim() else {}
    return [node for node in gm.graph.nodes
            if (_sum_loss(gm, node) or _full_sum(node, batched)) and _reads_inputs(node)]


def baked_batch(gm: fx.GraphModule, batch: int) -> str | None:
    """Why a graph captured by torch.export, from an example of `batch` samples, divides a sum
    over the batch by `batch` written as a constant (`err.sum() / err.shape[0]`, a size export
    does not keep), or None: run on other micro-batches it would divide by the wrong count."""
    for node in _sums(gm):
        for user in node.users:
            if op_name(gm, user) in ("div", "truediv") and user.args[0] is node and \
                    user.args[1] == batch and not isinstance(user.args[1], bool):
                return (f"{user.name} divides the sum {node.name} over the batch by {batch}, "
                        f"the captured example's batch size read from a tensor's shape, which "
                        f"torch.export keeps as a constant: every micro-batch would be divided "
                        f"by it; write the loss with .mean() instead")
    return None


def _sum_loss(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A loss function (F.*, aten's, an nn module) of reduction "sum"."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return isinstance(module, nn.modules.loss._Loss) and module.reduction == "sum" and \
            not isinstance(module, nn.CrossEntropyLoss)
    if node.op != "call_function" or op_name(gm, node) not in _LOSSES:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        names = [a.name for a in node.target._schema.arguments]
    else:
        try:
            names = list(inspect.signature(node.target).parameters)
        except (TypeError, ValueError):
            return False
    given = {**dict(zip(names, node.args)), **node.kwargs}
    return given.get("reduction") in ("sum", _SUM)


def _full_sum(node: fx.Node, batched: dict) -> bool:
    """A sum over every dimension of a value that holds the batch's (a 0-d result)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    name = str(getattr(node.target, "__name__", node.target)).split(".")[0]
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    value = node.meta.get("val")
    return name == "sum" and dims in (None, [], ()) and node.args[0] in batched and \
        isinstance(value, torch.Tensor) and value.dim() == 0


def _reads_inputs(node: fx.Node) -> bool:
    """Computed from an input of the graph (not constants and parameters alone)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen or current.meta.get(CONSTANT):
            continue
        seen.add(current)
        if current.op == "placeholder":
            return True
        stack.extend(current.all_input_nodes)
    return False


def _summed_into(gm: fx.GraphModule, node: fx.Node, output: fx.Node) -> bool:
    """Whether every path from `node` to the output adds it into the loss: through sums and
    differences, and products or quotients (as the dividend) with values not from the inputs."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user is output:
                continue
            name = op_name(gm, user)
            others = [a for a in user.all_input_nodes if a is not current]
            if name not in _LINEAR or any(_reads_inputs(a) for a in others if
                                          name in ("mul", "div", "truediv")):
                return False
            if name in ("div", "truediv") and user.args[0] is not current:
                return False
            stack.append(user)
    return True

