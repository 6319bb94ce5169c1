"""Expert-parallel rewrite: each rank keeps E/ep of every mixture-of-experts layer's experts.

A MoE layer is one `runtime.experts.dispatch.moe_ffn` call node whose weights are read by get_attr: the
router [E, h] (kept whole: every rank routes its own tokens over all experts) and the stacked
expert weights w_gate, w_up [E, f, h] and w_down [E, h, f]; or one `torch.ops.fxpar.routed_experts`
op (torch.export) with its gate_up and down weights and, when biased (GPT-OSS), their biases
[E, 2f] and [E, h], every one stacked over the E experts on dim 0 whatever its layout
(runtime.experts.custom_op). The rewrite replaces each stacked weight and bias by rows
[i E/ep, (i+1) E/ep) for the rank at index i of its expert-parallel group, marks it
(`param.fxpar_expert`, a runtime.programs.shards.ShardSpec on dim 0, so the runtime joins the
experts of a full state dict and reduces their gradients over the ranks holding the same experts
only), and sets the node's `ep` (dispatch and combine over the EP group) and `tag` (its layer, under
which the all-to-all bytes are counted).

The graph's shapes do not change: moe_ffn maps [b, s, h] to [b, s, h] whatever ep is.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from passes.rewrite.sharding import LAYER, ShardingError, get_param, replace_param
import torch

from runtime.comm import collectives  # noqa: F401 - registers torch.ops.fxpar
from runtime.experts import custom_op as expert_op
from runtime.experts.dispatch import moe_ffn
from runtime.programs.shards import ShardSpec

_EXPERT_ARGS = (2, 3, 4)   # w_gate, w_up, w_down among moe_ffn's positional arguments
_OP_EXPERT_ARGS = expert_op.EXPERT_ARGS   # gate_up, down, gate_up_bias, down_bias (or None)


def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """moe_ffn calls (symbolic tracing) and routed_experts ops (torch.export)."""
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and (n.target is moe_ffn or _is_op(n))]


def _is_op(node: fx.Node) -> bool:
    return node.target is getattr(torch.ops.fxpar, "routed_experts").default


def expert_parallel(gm: fx.GraphModule, ep: int, rank: int) -> list[str]:
    """Cut every MoE layer's experts for EP index `rank` of `ep`; in place. Returns the names of
    the parameters cut. Raises ShardingError when ep does not divide a layer's expert count or
    the model has no MoE layer."""
    nodes = moe_nodes(gm)
    if ep > 1 and not nodes:
        raise ShardingError(f"expert parallel ep={ep} needs mixture-of-experts layers; the model "
                            f"has none (use ep=1)")
    cut = []
    for node in nodes:
        layer = node.meta.get(LAYER, node.name)
        op = _is_op(node)
        experts = expert_op.arguments(node)["experts"] if op else \
            _param(gm, node.args[1], layer).shape[0]
        if experts % ep:
            raise ShardingError(f"layer {layer}: {experts} experts do not divide over ep={ep}; "
                                f"use an ep that divides {experts}")
        if ep > 1:
            for arg in (_op_weights(node) if op else [node.args[i] for i in _EXPERT_ARGS]):
                cut.append(_cut(gm, arg, ShardSpec(0, ep, rank), layer))
        if op:  # (x, weights, index, gate_up, down, ep, tag, experts, biases, kind, ...)
            node.args = (*node.args[:5], ep, layer, *node.args[7:])
        else:
            node.kwargs = {**node.kwargs, "ep": ep, "tag": layer}
    return cut


def _op_weights(node: fx.Node) -> list:
    """A routed_experts node's expert weights and the biases it has (an unbiased node holds None
    or, exported with its defaults left off, nothing there)."""
    args = expert_op.arguments(node)
    return [args[expert_op.ARGS[i]] for i in _OP_EXPERT_ARGS
            if args[expert_op.ARGS[i]] is not None]


def _param(gm, arg, layer: str):
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        raise ShardingError(f"layer {layer}: moe_ffn's weights must be parameters read by "
                            f"get_attr, got {arg}")
    return get_param(gm, str(arg.target))


def _cut(gm, arg, spec: ShardSpec, layer: str) -> str:
    full = _param(gm, arg, layer)
    if getattr(full, "fxpar_expert", None) is not None:   # read twice: cut once
        return str(arg.target)
    param = nn.Parameter(spec.take(full.detach()), full.requires_grad)
    param.fxpar_expert = spec
    replace_param(gm, str(arg.target), param)
    return str(arg.target)


def sequence_refusal(gm: fx.GraphModule, layers, sp: bool = False) -> str | None:
    """Why the sequence of these layers' MoE nodes cannot be split, or None. Context parallel
    (sp=False) always can: tokens are routed one by one, and the balance loss's per-sequence
    statistics are summed over the cp group (`split_balance`). Sequence parallel (sp=True) is
    not implemented for MoE layers: their tokens would need the tp ranks' shards regathered
    around the experts."""
    if not sp:
        return None
    names = {n for layer_nodes in layers for n in layer_nodes}
    for node in moe_nodes(gm):
        if node.name in names:
            return (f"{node.meta.get(LAYER, node.name)}: a mixture-of-experts layer is run with "
                    f"its sequence whole on every tp rank (use tp without sp there)")
    return None


def split_balance(gm: fx.GraphModule, cp: int, group: str = "cp") -> list[str]:
    """Context parallel: every MoE node with a balance loss (moe_ffn with aux_coef) sums its
    per-sequence statistics over the `cp` ranks of the named group before forming the loss
    (runtime.experts.dispatch: seq_parts, seq_group; counted under the layer's tag), so that loss and
    gradients are those of the whole sequences; in place. Returns the nodes' layers. Nodes
    without a balance loss (and routed_experts ops, which have none) need nothing: their tokens
    are routed one by one."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ShardingError(f"context-parallel size must be a positive integer, got {cp!r}")
    done = []
    for node in moe_nodes(gm):
        if cp == 1 or _is_op(node) or not node.kwargs.get("aux_coef"):
            continue
        layer = node.meta.get(LAYER, node.name)
        node.kwargs = {**node.kwargs, "seq_parts": cp, "seq_group": group, "tag": layer}
        done.append(layer)
    if done:
        gm.recompile()
    return done


def read_replicated(gm: fx.GraphModule) -> None:
    """After the tensor-parallel rewrite: a MoE node reading its input through tp_copy (the
    column-parallel shared expert beside it shares the input) reads the value itself. moe_ffn
    is replicated over tp, so its input gradient is whole on every rank; through tp_copy's
    backward all-reduce it would be counted tp times."""
    for node in moe_nodes(gm):
        source = node.args[0]
        if isinstance(source, fx.Node) and source.target is collectives.tp_copy:
            node.replace_input_with(source, source.args[0])
    gm.graph.lint()
    gm.recompile()
