"""Cost rules for the ops real models bring (routers, grouped and convolutional matmuls, complex
rotary embeddings, ALiBi and soft-capping), checked against shape arithmetic; and captured
Hugging Face graphs with every op priced by a rule, none by the memory-bound fallback."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from cost_model.ops.fallback import UnpricedOpWarning
from cost_model.ops.node_cost import node_cost


def _priced(model, *inputs, export=False):
    """{node name: OpCost}, failing on any op the fallback had to price."""
    if export:
        gm = torch.export.export(model, inputs, strict=False).module()
    else:
        gm = torch.fx.symbolic_trace(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(x) for x in inputs])
    modules = dict(gm.named_modules())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnpricedOpWarning)
        return {n.name: node_cost(n, modules) for n in gm.graph.nodes}


def _one(costs, fragment):
    (cost,) = [c for name, c in costs.items() if fragment in name]
    return cost


def test_convolutions_count_two_flops_per_weight_element_and_output_position():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 4, groups=8, padding=3)  # a Mamba-style causal conv

        def forward(self, x):
            return F.conv1d(x, torch.ones(8, 8, 3)) + self.conv(x)[..., :10]

    x = torch.randn(2, 8, 12)
    costs = _priced(M(), x)
    functional, module = costs["conv1d"], costs["conv"]
    assert functional.fwd_flops == 2 * (2 * 8 * 10) * (8 * 3)
    assert module.fwd_flops == 2 * (2 * 8 * 15) * 4
    assert functional.bwd_flops == 2 * functional.fwd_flops


def test_router_topk_keeps_its_choice_and_counting_has_no_backward():
    class Router(nn.Module):
        def forward(self, scores):
            weights, chosen = torch.topk(scores.softmax(-1), 2, dim=-1)
            counts = torch.histc(chosen.float(), bins=8, min=0, max=7)
            return weights.sum() + counts.sum()

    costs = _priced(Router(), torch.randn(4, 8, requires_grad=True), export=True)
    topk, histc = _one(costs, "topk"), _one(costs, "histc")
    assert topk.bwd_flops > 0 and topk.saved and topk.saved[0][1] == 4 * 2 * 4
    assert histc.bwd_flops == 0 and histc.saved == ()


def test_complex_rotary_polar_and_views_are_priced():
    class Rotary(nn.Module):
        def forward(self, x, angles):
            freqs = torch.polar(torch.ones_like(angles), angles)
            rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs
            return torch.view_as_real(rotated).flatten(-2)

    costs = _priced(Rotary(), torch.randn(2, 4, 8), torch.randn(4, 4), export=True)
    assert _one(costs, "polar").fwd_bytes > 0
    assert _one(costs, "view_as_complex").fwd_bytes == 0


@pytest.mark.parametrize("arch", ["bloom", "gemma2", "qwen3_moe", "falcon_h1", "llama4_text"])
def test_hugging_face_graphs_need_no_fallback(arch):
    """ALiBi (bloom), soft-capping and alternating sliding windows (gemma2), a router and grouped
    expert matmuls (qwen3_moe), a Mamba conv (falcon_h1), complex rotary (llama4)."""
    pytest.importorskip("transformers")
    from passes.capture.trace import capture
    from planner.search.costs import ModelCosts
    from planner.models.hf import build_hf, vocab_size
    model = build_hf(arch)
    tokens = torch.randint(0, vocab_size(model), (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnpricedOpWarning)
        captured = capture(model, (tokens, tokens))
        ModelCosts(captured, len(captured.blocks), 4)
    modules = dict(captured.gm.named_modules())
    for node in captured.gm.graph.nodes:  # grouped expert matmuls: 2·M·N·K
        if "grouped_mm" in node.name:
            a, out = node.args[0].meta["val"], node.meta["val"]
            assert node_cost(node, modules).fwd_flops == 2 * out.numel() * a.shape[-1]
