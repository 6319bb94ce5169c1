"""cost_model.ops.moe against brute force: the expected maximum load of uniform top-k routing
against sampling, and a MoE node's FLOPs against the formula."""
import random

import pytest
import torch

from cost_model.ops.moe import MoEFacts, _max_normal, expected_max_load, pricing


def _sampled_max_load(tokens, experts, k, ep, trials=400, seed=0):
    rng = random.Random(seed)
    group = experts // ep
    total = 0
    for _ in range(trials):
        loads = [0] * ep
        for _ in range(tokens):
            for e in rng.sample(range(experts), k):
                loads[e // group] += 1
        total += max(loads)
    return total / trials / (tokens * k / ep)


@pytest.mark.parametrize("tokens,experts,k,ep", [(256, 8, 2, 2), (256, 8, 2, 8), (128, 32, 8, 4),
                                                 (512, 64, 6, 8)])
def test_expected_max_load_matches_sampling(tokens, experts, k, ep):
    want = _sampled_max_load(tokens, experts, k, ep)
    assert abs(expected_max_load(tokens, experts, k, ep) - want) < 0.02 * want


def test_max_of_normals_known_values():
    # E[max of n standard normals]: 0.5642 for 2, 1.0294 for 4, 1.4236 for 8 (tables)
    for n, value in [(2, 0.5642), (4, 1.0294), (8, 1.4236)]:
        assert abs(_max_normal(n) - value) < 1e-3


def test_no_imbalance_without_expert_parallel_and_its_limit():
    assert expected_max_load(100, 8, 2, 1) == 1.0
    assert expected_max_load(10**7, 8, 2, 8) == pytest.approx(1.0, abs=2e-3)
    with pytest.raises(ValueError, match="imbalance must be >= 1"):
        pricing(MoEFacts(64, 8, 4, 2, 16, 2), 2, imbalance=0.9)


def test_moe_node_flops_equal_formula():
    from passes.capture.trace import capture
    from planner.models.presets import build_model, get_config
    from cost_model.ops.node_cost import node_cost
    cfg = get_config("mixtral-tiny")
    model = build_model(cfg.with_(layers=1))
    tokens = torch.zeros(2, cfg.seq, dtype=torch.long)
    captured = capture(model, (tokens, tokens))
    (node,) = [n for n in captured.gm.graph.nodes if "moe_ffn" in n.name]
    cost = node_cost(node, dict(captured.gm.named_modules()))
    t, h, e, f, k = 2 * cfg.seq, cfg.hidden, cfg.experts, cfg.expert_ffn, cfg.top_k
    assert cost.fwd_flops == 2 * t * h * e + 6 * t * k * h * f
    assert cost.bwd_flops == 2 * cost.fwd_flops
    assert dict(cost.saved)[f"{node.name}:experts"] == t * k * (3 * h + 4 * f) * 4


@pytest.mark.parametrize("name,limit", [("deepseek-tiny", (4, 2)), ("mixtral-tiny", (1, 1))])
def test_moe_facts_carry_the_presets_group_limit(name, limit):
    from passes.capture.trace import capture
    from planner.models.presets import build_model, get_config
    from cost_model.ops.moe import facts
    cfg = get_config(name)
    model = build_model(cfg.with_(layers=cfg.dense_layers + 1))
    tokens = torch.zeros(2, cfg.seq, dtype=torch.long)
    captured = capture(model, (tokens, tokens))
    (node,) = [n for n in captured.gm.graph.nodes if "moe_ffn" in n.name]
    assert facts(node).group_limit == limit
