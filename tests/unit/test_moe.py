"""Mixture-of-experts routing and experts against a brute-force per-token sum, and the balance
loss against its formula written out token by token."""
import pytest
import torch
import torch.nn.functional as F

from planner.models.presets import build_model, example_batch, get_config
from runtime.experts.dispatch import moe_ffn


def _brute(x, router, wg, wu, wd, k, score, scale):
    """sum over each token's top-k experts of weight x SwiGLU, one token at a time."""
    out = torch.zeros_like(x)
    logits = x @ router.t()
    for t in range(x.shape[0]):
        p = F.softmax(logits[t], -1) if score == "softmax" else torch.sigmoid(logits[t])
        top, idx = p.topk(k)
        top = top / top.sum() * scale
        for w, e in zip(top, idx):
            out[t] += w * (wd[e] @ (F.silu(wg[e] @ x[t]) * (wu[e] @ x[t])))
    return out


@pytest.mark.parametrize("score,k,scale", [("softmax", 2, 1.0), ("sigmoid", 3, 2.5)])
def test_moe_ffn_equals_per_token_sum(score, k, scale):
    gen = torch.Generator().manual_seed(1)
    e, h, f, t = 6, 8, 5, 20
    x, router = torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen)
    wg, wu, wd = (torch.randn(e, f, h, generator=gen), torch.randn(e, f, h, generator=gen),
                  torch.randn(e, h, f, generator=gen))
    y, aux = moe_ffn(x.unsqueeze(0), router, wg, wu, wd, top_k=k, score=score, scale=scale)
    assert aux is None
    torch.testing.assert_close(y[0], _brute(x, router, wg, wu, wd, k, score, scale),
                               rtol=1e-5, atol=1e-5)


def test_balance_loss_formula():
    gen = torch.Generator().manual_seed(2)
    b, s, h, e, k, coef = 3, 7, 4, 5, 2, 0.1
    x, router = torch.randn(b, s, h, generator=gen), torch.randn(e, h, generator=gen)
    w = torch.zeros(e, 1, h)
    _, aux = moe_ffn(x, router, w, w, torch.zeros(e, h, 1), top_k=k, aux_coef=coef)
    want = 0.0
    for seq in range(b):
        p = F.softmax(x[seq] @ router.t(), -1)
        idx = p.topk(k).indices
        counts = torch.stack([(idx == i).sum() for i in range(e)]).float()
        want += float((counts * e / (k * s) * p.mean(0)).sum()) / b
    assert abs(float(aux) - coef * want) < 1e-6


@pytest.mark.parametrize("name", ["mixtral-tiny", "deepseek-tiny"])
def test_moe_presets_train_and_capture(name):
    from passes.capture.trace import capture
    config = get_config(name)
    model = build_model(config)
    batch = example_batch(config, 2)
    captured = capture(model, batch)
    blocks = captured.blocks
    assert len(blocks) == config.layers
    kinds = {b.signature for b in blocks[config.dense_layers:]}
    assert len(kinds) == 1                       # every MoE block is one kind
    if config.dense_layers:
        assert blocks[0].signature not in kinds  # dense first blocks are another
    torch.testing.assert_close(captured.gm(*batch), model(*batch))


def test_bad_moe_configs_are_refused():
    base = get_config("mixtral-tiny")
    with pytest.raises(ValueError, match="top_k must be between 1 and experts=8"):
        base.with_(top_k=9)
    with pytest.raises(ValueError, match="router must be 'softmax' or 'sigmoid'"):
        base.with_(router="relu")
    with pytest.raises(ValueError, match="dense_layers must be in"):
        base.with_(dense_layers=4)


# -- group-limited routing (DeepSeek-V3) ---------------------------------------------------------

def _hf_router(experts, groups, topk_groups, k, hidden, gen):
    """transformers' DeepseekV3TopkRouter at a small size, with random weights and a random
    e_score_correction_bias (DeepSeek's balancing bias: it steers the choice, not the weights)."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, n_group=groups,
                              topk_group=topk_groups, num_experts_per_tok=k,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(experts, generator=gen))
    return router


def _groups_hit(index, size: int, groups: int):
    """Per token, how many groups (of `size` consecutive experts) its experts fall in."""
    hit = torch.zeros(index.shape[0], groups).scatter_(1, index // size, 1)
    return hit.sum(1)


def _by_expert(weights, index):
    """Each token's (experts, weights) in expert order (topk's order is not part of the choice)."""
    order = index.argsort(-1)
    return index.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("experts,groups,topk_groups,k", [(16, 4, 2, 4), (256, 8, 4, 8),
                                                          (32, 4, 2, 8), (12, 3, 1, 2)])
def test_route_equals_transformers_deepseek_v3_router(experts, groups, topk_groups, k):
    from runtime.experts.dispatch import route
    gen = torch.Generator().manual_seed(3)
    hidden, tokens = 16, 512
    router = _hf_router(experts, groups, topk_groups, k, hidden, gen)
    x = torch.randn(tokens, hidden, generator=gen)    # random floats: no ties among the scores
    _, want_w, want_i = router(x)
    bias = router.e_score_correction_bias
    _, got_w, got_i = route(x @ router.weight.t(), k, "sigmoid", True, 2.5, groups, topk_groups,
                            bias)
    want_i, want_w = _by_expert(want_w, want_i)
    got_i, got_w = _by_expert(got_w, got_i)
    torch.testing.assert_close(got_i, want_i, rtol=0, atol=0)
    torch.testing.assert_close(got_w, want_w)
    # every token within its topk_groups groups, and the limit binds: the unlimited top k
    # (by the same biased scores) differs for some tokens
    assert int(_groups_hit(got_i, experts // groups, groups).max()) <= topk_groups
    free = (torch.sigmoid(x @ router.weight.t()) + bias).topk(k, dim=-1).indices.sort(-1).values
    assert (free != got_i).any()


def _brute_grouped(x, router, wg, wu, wd, k, groups, keep, scale):
    """One token at a time: its `keep` groups of highest top-2 sigmoid score, its top k experts
    among theirs, weights the normalised scores x scale, summed over the SwiGLU experts."""
    out = torch.zeros_like(x)
    size = router.shape[0] // groups
    for t in range(x.shape[0]):
        p = torch.sigmoid(router @ x[t])
        group_score = [float(p[g * size:(g + 1) * size].topk(2).values.sum())
                       for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        top = sorted(allowed, key=lambda e: -float(p[e]))[:k]
        weights = p[top] / p[top].sum() * scale
        for w, e in zip(weights, top):
            out[t] += w * (wd[e] @ (F.silu(wg[e] @ x[t]) * (wu[e] @ x[t])))
    return out


def test_group_limited_moe_ffn_equals_per_token_sum():
    gen = torch.Generator().manual_seed(4)
    e, h, f, t, k, groups, keep = 16, 8, 5, 40, 3, 4, 2
    x, router = torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen)
    wg, wu, wd = (torch.randn(e, f, h, generator=gen), torch.randn(e, f, h, generator=gen),
                  torch.randn(e, h, f, generator=gen))
    y, _ = moe_ffn(x.unsqueeze(0), router, wg, wu, wd, top_k=k, score="sigmoid", scale=2.5,
                   groups=groups, topk_groups=keep)
    torch.testing.assert_close(y[0], _brute_grouped(x, router, wg, wu, wd, k, groups, keep, 2.5),
                               rtol=1e-5, atol=1e-5)
    unlimited, _ = moe_ffn(x.unsqueeze(0), router, wg, wu, wd, top_k=k, score="sigmoid",
                           scale=2.5)
    assert not torch.allclose(y, unlimited)   # the limit changes some tokens' experts


def test_deepseek_tiny_routes_within_its_groups_and_trains_as_its_graph(monkeypatch):
    """The preset limits each token to 2 of 4 groups (of 8 experts); its captured graph trains
    as the eager model does, step by step (losses, every gradient, final weights)."""
    import copy

    from passes.capture.trace import capture
    from planner.training.local import assert_same_run, train_in_one_process
    from runtime.experts import dispatch

    config = get_config("deepseek-tiny")
    assert (config.expert_groups, config.topk_groups) == (4, 2)
    v3 = get_config("deepseek-v3")
    assert (v3.expert_groups, v3.topk_groups) == (8, 4)
    torch.manual_seed(0)
    model = build_model(config)
    batch = example_batch(config, 4)
    graph = capture(copy.deepcopy(model), batch).gm
    chosen = []
    original = dispatch.route

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        chosen.append(out[2].flatten(0, -2))
        return out

    monkeypatch.setattr(dispatch, "route", spy)
    eager = train_in_one_process(model, batch, 3)
    assert_same_run(train_in_one_process(graph, batch, 3), eager)
    size = config.experts // config.expert_groups
    assert chosen and all(int(_groups_hit(index, size, config.expert_groups).max())
                          <= config.topk_groups for index in chosen)
    assert eager.losses[-1] < eager.losses[0]


def test_bad_group_limits_are_refused():
    base = get_config("deepseek-tiny")
    with pytest.raises(ValueError, match="5 expert groups must split the 32 experts"):
        base.with_(expert_groups=5)
    with pytest.raises(ValueError, match="topk_groups=5 exceeds the 4 expert groups"):
        base.with_(topk_groups=5)
    with pytest.raises(ValueError, match="top_k=8 exceeds the 4 experts"):
        base.with_(expert_groups=8, topk_groups=1)
    assert get_config("mixtral-tiny").expert_groups == 1   # other presets: no limit
