"""The tensor-parallel dropout stream through activation checkpointing: a recomputed region draws
the masks its forward drew, and the stream goes on as if nothing had been recomputed."""
import torch

from passes.recompute import checkpointed
from runtime import rng


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
