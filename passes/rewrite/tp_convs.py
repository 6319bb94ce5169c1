"""The tensor-parallel dataflow check's rule for convolutions (passes.rewrite.tp_dataflow).

A depthwise convolution - one group per channel, as the short causal convolutions of Mamba,
Hyena and gated delta-net blocks are - works channel by channel: where its input is sharded
along the channels as equal contiguous blocks (a column-parallel output), each rank convolves
its own channels with its rows of the weight and bias, and the output stays sharded alike. The
rewrite then sets the rank's group count (`Findings.depthwise`) and cuts the weight and bias
along their first dimension (`Findings.cut_params`), each rank training its own rows. A
convolution that mixes channels reads features other ranks hold: refused, naming it.
"""
from __future__ import annotations

import copy

import torch.fx as fx
import torch.nn as nn

from passes.rewrite.sharding import full_size, get_param
from passes.rewrite.tp_views import _arg, _val, op_name

CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_FUNCTIONS = {"conv1d", "conv2d", "conv3d", "convolution"}


def _groups_at(gm: fx.GraphModule, node: fx.Node) -> int:
    """Where a convolution call takes its group count: aten.convolution's (input, weight, bias,
    stride, padding, dilation, transposed, output_padding, groups), conv1d/2d/3d's 7th."""
    return 8 if op_name(gm, node) == "convolution" else 6


class ConvRules:
    """Rule of tp_dataflow._Flow for convolutions: sets self.dim[node] or fails."""

    def _conv(self, node: fx.Node, src: fx.Node, d: int) -> None:
        weight, bias, groups = self._conv_parts(node)
        channels = _val(src).shape[1] if _val(src) is not None and _val(src).dim() > 1 else None
        if node.args[0] is not src or d != 1:
            self.fail(node, f"convolves with a value sharded over tp={self.tp} on dimension {d}"
                            f" of {src.name} (only a depthwise convolution of sharded channels, "
                            f"dimension 1, works shard by shard)")
        if channels is None or groups != channels or weight is None or \
                weight.shape[0] != channels:
            why = (f"mixes the channels it convolves (groups={groups} over {channels} "
                   f"channels), of which each rank holds 1/tp={self.tp}; only a depthwise "
                   f"convolution (groups = channels, as Mamba's short convolution) works shard "
                   f"by shard")
            self._gather_instead([src], split=True, why=(node, why))  # its projection whole
            self.fail(node, why)
        if src not in self.blocks or self.outer.get(src, 1) > 1:
            self.fail(node, f"convolves channels of {src.name} that are not each rank's "
                            f"contiguous block (a fused projection before its split, or "
                            f"channels merged with another dimension)")
        for path in self._conv_param_paths(node):
            self.found.cut_params[path] = 0
        self.found.depthwise.add(node)
        self.dim[node] = 1
        self.blocks.add(node)

    def _conv_parts(self, node: fx.Node):
        """(weight, bias, groups) of a convolution module call or function call."""
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            return module.weight, module.bias, module.groups
        weight, bias = (_arg(node, i, n) for i, n in ((1, "weight"), (2, "bias")))
        groups = _arg(node, _groups_at(self.gm, node), "groups", 1)
        if isinstance(groups, fx.Node):  # read at run time (x.shape[1]): its value here
            groups = groups.meta.get("val")
        return _val(weight), _val(bias) if isinstance(bias, fx.Node) else None, groups

    def _conv_param_paths(self, node: fx.Node) -> list[str]:
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            return [f"{node.target}.{name}" for name, _ in module.named_parameters()]
        params = [_arg(node, 1, "weight"), _arg(node, 2, "bias")]
        for p in params:
            if isinstance(p, fx.Node) and p.op != "get_attr":
                self.fail(node, f"convolves with a weight computed in the graph ({p.name}); "
                                f"only a parameter read as it is can be cut per rank")
        return [str(p.target) for p in params if isinstance(p, fx.Node)]


def cut_depthwise(gm: fx.GraphModule, node: fx.Node, tp: int) -> None:
    """Before its weight and bias are cut (Findings.cut_params): a depthwise convolution's group
    count, and a module's channel counts, set to the rank's channels. A module is replaced by a
    copy of its own (the capture's program shares the model's modules: cutting the one it has
    would cut the model's)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if getattr(module.weight, "fxpar_shard", None) is not None:
            return  # applied at several places: cut by the first
        rank_module = copy.copy(module)
        rank_module._parameters = dict(module._parameters)
        rank_module.groups = rank_module.in_channels = rank_module.out_channels = \
            module.weight.shape[0] // tp
        gm.add_submodule(node.target, rank_module)
        return
    groups = full_size(get_param(gm, str(_arg(node, 1, "weight").target)), 0) // tp
    index = _groups_at(gm, node)
    if isinstance(_arg(node, index, "groups"), fx.Node):
        return  # read from the rank's channels at run time
    if len(node.args) > index:
        node.args = (*node.args[:index], groups, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, "groups": groups}
