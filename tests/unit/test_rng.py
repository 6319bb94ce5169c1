"""The tensor-parallel dropout stream through activation checkpointing: a recomputed region draws
the masks its forward drew, and the stream goes on as if nothing had been recomputed."""
import pytest
import torch

from passes.rewrite.recompute import checkpointed
from runtime.training import rng


class _Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return rng.tp_dropout(self.lin(x), p=0.5).sum(dim=-1)


def _grads(run, body, x):
    rng.tp_generator().manual_seed(1234)
    x = x.clone().requires_grad_()
    run(body, x).sum().backward()
    after = torch.rand(4, generator=rng.tp_generator())  # the stream's next draw
    grads = [x.grad] + [p.grad.clone() for p in body.parameters()]
    body.zero_grad()
    return grads, after


def test_recomputed_tp_dropout_draws_the_forwards_masks():
    torch.manual_seed(0)
    body, x = _Body(), torch.randn(8, 16)
    plain, plain_next = _grads(lambda b, t: b(t), body, x)
    ckpt, ckpt_next = _grads(checkpointed, body, x)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(plain_next, ckpt_next, rtol=0, atol=0)


def test_replay_is_re_enterable():
    replay = rng.StreamReplay()
    gen = rng.tp_generator()
    with replay.forward():
        first = torch.rand(3, generator=gen)
    ctx = replay.recompute()
    for _ in range(2):   # input and weight gradients computed apart recompute twice
        before = gen.get_state()
        with ctx:
            again = torch.rand(3, generator=gen)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        assert torch.equal(gen.get_state(), before)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.lin(x).unflatten(-1, (2, 4)).transpose(1, 2)
        return rng.tp_scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=True)


def test_fused_attention_dropout_draws_from_the_tp_stream():
    """Two tp ranks (different tp seeds) drop different elements, one seed the same ones; the
    default generator is left where it was; recomputation draws the forward's masks."""
    x = torch.randn(2, 6, 8)
    body = _Attention()

    def run(tp_index):
        rng.seed_ranks(7, tp_index)
        before = torch.get_rng_state()
        out = body(x)
        assert torch.equal(torch.get_rng_state(), before)
        return out

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))
    rng.seed_ranks(7, 0)
    plain, plain_next = _grads(lambda b, t: b(t), body, x)
    ckpt, ckpt_next = _grads(checkpointed, body, x)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(plain_next, ckpt_next, rtol=0, atol=0)


def test_tensor_parallel_makes_a_dropping_sdpa_draw_per_rank():
    pytest.importorskip("transformers")
    from passes.capture.trace import capture
    from passes.stages.program import Layout, rewrite
    from passes.rewrite.sharding import is_sdpa
    from planner.training.local import HFSpec, build
    model, batch = build(HFSpec("llama", global_batch=2, seq=16,
                                overrides=(("attention_dropout", 0.1),)))
    captured = capture(model, tuple(x[:1] for x in batch))
    layout = Layout(2, tuple((b.name, "tp") for b in captured.blocks), (len(captured.layers),))
    gm = rewrite(captured, layout, tp_rank=1)
    targets = [n.target for n in gm.graph.nodes if is_sdpa(n)]
    assert len(targets) == 2 and all(t is rng.tp_scaled_dot_product_attention for t in targets)
