"""Hugging Face MoE experts run as torch.ops.fxpar.routed_experts equal transformers' own
forward (loss and every gradient), export as one node per layer, and are priced by formula."""
import pytest
import torch

pytest.importorskip("transformers")

from cost_model.ops.node_cost import node_cost  # noqa: E402
from passes.capture.trace import capture  # noqa: E402
from planner.models.hf import build_hf  # noqa: E402
from planner.models.hf_moe import use_routed_experts  # noqa: E402


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])  # qwen3_moe: mixtral's experts module
def test_routed_experts_equal_transformers(arch):
    torch.manual_seed(0)
    model = build_hf(arch)
    layers = model.model.model.layers
    moe_layers = sum(any(type(m).__name__.endswith("Experts") for m in layer.modules())
                     for layer in layers)
    assert moe_layers == (1 if arch == "deepseek_v3" else len(layers))  # dense first block
    tokens = torch.randint(0, 100, (2, 16))
    want = model(tokens, tokens)
    want.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    assert use_routed_experts(model) == moe_layers
    got = model(tokens, tokens)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6)
    captured = capture(model, (tokens, tokens))
    nodes = [n for n in captured.gm.graph.nodes if "routed_experts" in str(n.target)]
    assert len(nodes) == moe_layers
    cfg = model.model.config
    cost = node_cost(nodes[0], dict(captured.gm.named_modules()))
    t, h, k, f = 32, cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size \
        if arch in ("qwen3_moe", "deepseek_v3") else cfg.intermediate_size
    assert cost.fwd_flops == 6 * t * k * h * f


def test_a_model_without_experts_is_refused():
    with pytest.raises(ValueError, match="no Hugging Face experts module"):
        use_routed_experts(build_hf("llama"))


@pytest.mark.parametrize("arch,limit", [("deepseek_v3", (2, 1)), ("mixtral", (1, 1))])
def test_routed_experts_carry_the_routers_group_limit(arch, limit):
    """DeepSeek-V3's router (8 experts in n_group 2, topk_group 1 at the small size) lies outside
    the op: use_routed_experts hands its limit to the op, whose MoEFacts carry it."""
    from cost_model.ops.moe import facts
    model = build_hf(arch)
    cfg = model.model.config
    if arch == "deepseek_v3":
        assert (cfg.n_group, cfg.topk_group) == limit
    use_routed_experts(model)
    tokens = torch.randint(0, 100, (2, 16))
    captured = capture(model, (tokens, tokens))
    nodes = [n for n in captured.gm.graph.nodes if "routed_experts" in str(n.target)]
    assert nodes and all(facts(n).group_limit == limit for n in nodes)


def test_routed_experts_without_the_group_arguments_still_run():
    """Calls written before the op took groups (its trailing arguments default to no limit)."""
    from runtime.experts.custom_op import routed_experts
    gen = torch.Generator().manual_seed(0)
    e, h, f, t, k = 4, 8, 6, 5, 2
    x, gate_up, down = (torch.randn(t, h, generator=gen), torch.randn(e, 2 * f, h, generator=gen),
                        torch.randn(e, h, f, generator=gen))
    weights = torch.rand(t, k, generator=gen)
    index = torch.randperm(e, generator=gen)[:k].repeat(t, 1)
    old = routed_experts(x, weights, index, gate_up, down, 1, "moe", e)
    torch.testing.assert_close(old, routed_experts(x, weights, index, gate_up, down, 1, "moe", e,
                                                   groups=2, topk_groups=1))
    with pytest.raises(ValueError, match="3 expert groups must split the 4 experts"):
        routed_experts(x, weights, index, gate_up, down, 1, "moe", e, groups=3, topk_groups=1)


@pytest.mark.parametrize("arch,cause,advice", [
    ("llama4_text", r"Llama4TextExperts has a forward of the hidden states alone \(as Llama "
                    r"4's: every expert on every token, the router's scores applied before\)",
     r'plan it with "moe_layers": \[\] in its \(text\) config, every layer dense, or a family '
     r"whose experts it computes \(mixtral, qwen3_moe, deepseek_v3, gpt_oss\)$"),
    ("aria_text", r"AriaExperts has transposed weights \(is_transposed: gate_up_proj "
                  r"\[experts, hidden, 2\*ffn\]\)",
     r"plan a family whose experts it computes \(mixtral, qwen3_moe, deepseek_v3, gpt_oss\)$"),
])
def test_experts_routed_experts_does_not_compute_are_refused_with_what_to_change(arch, cause,
                                                                                 advice):
    """One line: the experts module and what about it the op does not compute, what it does
    compute, and what to plan instead (Llama 4 also dense, by its moe_layers)."""
    with pytest.raises(ValueError, match=f"^{cause}; routed_experts computes SwiGLU experts "
                                         f"called as experts.*: {advice}") as err:
        use_routed_experts(build_hf(arch))
    assert "\n" not in str(err.value)


def test_llama4_with_the_advised_dense_layers_has_no_experts():
    from planner.models.hf_moe import has_experts
    assert not has_experts(build_hf("llama4_text", moe_layers=[]))
