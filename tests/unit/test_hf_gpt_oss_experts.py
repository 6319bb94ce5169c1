"""GPT-OSS experts (transposed, interleaved gate and up, biases, clamped SwiGLU) run as
torch.ops.fxpar.routed_experts equal transformers' GptOssExperts, forward and every gradient; the
expert-parallel rewrite cuts their biases with their weights; moe facts read their width f (not
h / 2) and count the biases; and experts modules of any other form are refused."""
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import GptOssConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

from cost_model.ops import moe  # noqa: E402
from cost_model.ops.node_cost import node_cost  # noqa: E402
from passes.capture.trace import capture  # noqa: E402
from passes.rewrite.expert_parallel import expert_parallel  # noqa: E402
from passes.rewrite.sharding import LAYER  # noqa: E402
from planner.models.hf import build_hf  # noqa: E402
from planner.models.hf_moe import use_routed_experts  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _experts(limit: float) -> GptOssExperts:
    """GptOssExperts in float64 with every parameter random (biases too: transformers starts
    them at 0, which would hide a missing bias)."""
    torch.manual_seed(0)
    module = GptOssExperts(GptOssConfig(**TINY, swiglu_limit=limit)).double()
    for p in module.parameters():
        nn.init.normal_(p, std=0.5)
    return module


def _routing(tokens: int, experts: int, k: int):
    gen = torch.Generator().manual_seed(1)
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64).softmax(-1)
    return index, weights.requires_grad_()


def _run(module, x, index, weights):
    out = module(x, index, weights)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2),
                           dtype=out.dtype)
    tensors = [x, weights, *module.parameters()]
    return out, torch.autograd.grad(out, tensors, grad_out)


@pytest.mark.parametrize("limit", [7.0, 1.0])  # 1.0: both clamps cut many values
def test_routed_op_equals_gpt_oss_experts_forward_and_backward(limit):
    module = _experts(limit)
    x = torch.randn(24, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    index, weights = _routing(24, TINY["num_local_experts"], TINY["num_experts_per_tok"])
    gate_up = x.detach() @ module.gate_up_proj[0] + module.gate_up_proj_bias[0]
    assert (gate_up.abs() > limit).any()  # the clamps are exercised
    want, want_grads = _run(module, x, index, weights)
    assert use_routed_experts(module) == 1
    got, got_grads = _run(module, x, index, weights)
    torch.testing.assert_close(got, want)
    names = ["x", "weights", *(n for n, _ in module.named_parameters())]
    for name, g, w in zip(names, got_grads, want_grads):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


def _tiny_model():
    torch.manual_seed(0)
    model = build_hf("gpt_oss", **TINY)
    for name, p in model.named_parameters():
        if "experts" in name and "bias" in name:
            nn.init.normal_(p, std=0.5)
    return model


def test_gpt_oss_model_equals_transformers_and_is_priced_at_width_f():
    model = _tiny_model()
    tokens = torch.randint(0, 100, (2, 16))
    want = model(tokens, tokens)
    want.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    assert use_routed_experts(model) == TINY["num_hidden_layers"]
    got = model(tokens, tokens)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6)
    captured = capture(model, (tokens, tokens))
    nodes = [n for n in captured.gm.graph.nodes if "routed_experts" in str(n.target)]
    assert len(nodes) == TINY["num_hidden_layers"]
    t, h, f, e, k = 32, 32, 48, 4, 2
    facts = moe.facts(nodes[0])
    assert (facts.hidden, facts.ffn, facts.experts, facts.top_k) == (h, f, e, k)
    assert facts.bias == e * (2 * f + h)
    assert facts.expert_param_bytes == (3 * e * h * f + e * (2 * f + h)) * 4
    cost = node_cost(nodes[0], dict(captured.gm.named_modules()))
    assert cost.fwd_flops == 6 * t * k * h * f
    assert cost.gemm == (t * k, f, h, e)


def test_expert_parallel_cuts_the_biases_with_the_weights():
    model = _tiny_model()
    tokens = torch.randint(0, 100, (2, 16))
    use_routed_experts(model)
    gm = capture(model, (tokens, tokens)).gm
    full = {n: p.detach().clone() for n, p in gm.named_parameters()}
    cut = expert_parallel(gm, 2, 1)
    suffixes = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    assert sorted(c.rsplit(".", 1)[-1] for c in cut) == sorted(suffixes * 2)
    params = dict(gm.named_parameters())
    for name in cut:
        torch.testing.assert_close(params[name].data, full[name][2:])  # rank 1 of 2: experts 2, 3
        assert params[name].fxpar_expert is not None
    node = next(n for n in gm.graph.nodes if "routed_experts" in str(n.target))
    assert node.args[5:8] == (2, node.meta.get(LAYER, node.name), 4)
    assert node.args[10:] == ("gpt_oss", 1.702, 7.0)
    assert moe.facts(node).ffn == 48 and moe.facts(node).bias == 4 * (2 * 48 + 32)


def test_swiglu_experts_facts_unchanged():
    torch.manual_seed(0)
    model = build_hf("mixtral", hidden_size=32, intermediate_size=48)
    tokens = torch.randint(0, 100, (2, 16))
    use_routed_experts(model)
    gm = capture(model, (tokens, tokens)).gm
    node = next(n for n in gm.graph.nodes if "routed_experts" in str(n.target))
    cfg = model.model.config
    facts = moe.facts(node)
    assert (facts.hidden, facts.ffn, facts.experts, facts.top_k, facts.bias) == \
        (32, 48, cfg.num_local_experts, cfg.num_experts_per_tok, 0)
    assert facts.expert_param_bytes == 3 * cfg.num_local_experts * 32 * 48 * 4


class FooExperts(nn.Module):
    """An experts module shaped like Mixtral's, its form set per test."""

    def __init__(self, **flags):
        super().__init__()
        self.num_experts = 2
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(2, 4, 4))
        self.act_fn = nn.SiLU()
        for k, v in flags.items():
            setattr(self, k, v)


class ClampedExperts(FooExperts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=7.0)) * up


ADVICE = (r"; routed_experts computes SwiGLU experts .*: plan a family whose experts it "
          r"computes \(mixtral")


@pytest.mark.parametrize("module,what", [
    (FooExperts(is_transposed=True), r"^FooExperts has transposed weights \(is_transposed: "
                                     r"gate_up_proj \[experts, hidden, 2\*ffn\]\)" + ADVICE),
    (FooExperts(has_bias=True, is_concatenated=False),
     r"^FooExperts has interleaved gate and up \(is_concatenated=False\); biases \(has_bias\)"
     + ADVICE),
    (FooExperts(has_post_expert_norm=True),
     r"^FooExperts has a norm after each expert \(has_post_expert_norm\)" + ADVICE),
    (FooExperts(act_fn=nn.GELU()), r"^FooExperts has activation GELU" + ADVICE),
    (ClampedExperts(), r"^ClampedExperts has its own gating function "
                       r"ClampedExperts._apply_gate" + ADVICE),
])
def test_other_experts_forms_are_refused(module, what):
    with pytest.raises(ValueError, match=what) as err:
        use_routed_experts(module)
    assert "\n" not in str(err.value)


def test_an_undecorated_module_of_another_layout_is_refused():
    module = FooExperts()
    module.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 8))  # [E, h, 2f], as Llama 4 holds it
    with pytest.raises(ValueError, match=r"FooExperts: gate_up_proj is \[2, 4, 8\] \(\[experts, "
                                         r"hidden, 2\*ffn\], transposed\), not the swiglu "
                                         r"layout's \[2, 8, 4\]" + ADVICE):
        use_routed_experts(module)
    assert "forward" not in vars(module)  # nothing swapped
