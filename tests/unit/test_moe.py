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
