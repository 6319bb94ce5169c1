"""Pointwise chains priced fused (cost_model.layers.fusion) against hand counts."""
import dataclasses

import torch
import torch.fx as fx
from torch import nn

from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.compute import op_seconds
from cost_model.layers.fusion import fused_bytes
from cost_model.ops.node_cost import node_cost
from passes.capture.trace import propagate_shapes

T, H = 64, 32          # tokens, width: every activation is T x H fp32 = 8 KiB
ACT = T * H * 4


class Chain(nn.Module):
    """linear -> (add bias', relu, view, mul by 2) -> linear, and the chain's middle also leaves
    to the output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.shift = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        y = torch.relu(self.a(x) + self.shift)
        z = y.view(T, H) * 2
        return self.b(z), y


def _graph():
    gm = fx.symbolic_trace(Chain())
    propagate_shapes(gm, (torch.empty(T, H),))
    modules = dict(gm.named_modules())
    classes = {n.name: node_cost(n, modules).op_class for n in gm.graph.nodes
               if n.op not in ("placeholder", "output", "get_attr")}
    return gm, classes


def test_a_chain_reads_what_enters_it_and_writes_what_leaves_it():
    gm, classes = _graph()
    moved = fused_bytes(gm, classes)
    ops = {n.target.__name__ if callable(n.target) else str(n.target): n.name
           for n in gm.graph.nodes if n.name in moved}
    assert set(ops) == {"add", "relu", "mul"}
    # add reads the first linear's output and the parameter, writes nothing (relu consumes it)
    assert moved[ops["add"]] == ACT + H * 4
    # relu's output leaves the chain (the module returns it): written once, read by nothing else
    assert moved[ops["relu"]] == ACT
    # mul reads relu's output through the view inside the chain, writes for the second linear
    assert moved[ops["mul"]] == ACT


def test_the_cluster_flag_prices_the_fused_bytes_and_no_more():
    from cost_model.layers.layer_cost import OpRecord
    op = OpRecord("elementwise", 2e6, 2e6, 4e6, 8e6, 0.0, False, fused_bytes=1e6)
    inside = dataclasses.replace(op, fused_bytes=0.0)
    eager = get_cluster("h100-sxm-dgx")
    fused = dataclasses.replace(eager, fused_pointwise=True)
    bw = eager.mem_bw * eager.bw_eff
    assert op_seconds(op, 1.0, eager, backward=False) == max(4e6 / bw, eager.kernel_floor)
    assert op_seconds(op, 1.0, fused, backward=False) == max(1e6 / bw, eager.kernel_floor)
    assert op_seconds(op, 1.0, fused, backward=True) == max(2e6 / bw, eager.kernel_floor)
    assert op_seconds(inside, 1.0, fused, backward=False) == 0.0
    assert op_seconds(inside, 1.0, eager, backward=False) > 0.0
