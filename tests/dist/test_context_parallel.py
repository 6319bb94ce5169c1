"""Context parallel on real gloo ranks against one process: ring attention, then whole models.

Attention: each rank holds its zig-zag share of q, k, v; the ring output and (dq, dk, dv) must equal
F.scaled_dot_product_attention of the full sequence (then sharded the same way) within 1e-5.
Models: capture -> context_parallel -> forward/backward on each rank's tokens, gradients averaged
over the cp (and dp) ranks, SGD with momentum; per-step losses, gradients and final parameters must
equal the same model trained on the whole batch in one process.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from passes.capture import capture
from passes.context_parallel import context_parallel
from planner.models import build_model, example_batch, get_config
from runtime import collectives
from runtime.cp_data import shard_sequence
from runtime.ring_attention import ring_attention

STEPS = 3
_SUBGROUPS: dict[tuple[int, int], list] = {}


def _subgroups(size: int, stride: int = 1) -> list:
    """Every rank's groups of `size` ranks `stride` apart, created once per worker (all ranks
    create all groups, in the same order)."""
    key = (size, stride)
    if key not in _SUBGROUPS:
        world = dist.get_world_size()
        starts = [s for s in range(world) if s % (size * stride) < stride]
        _SUBGROUPS[key] = [(ranks, dist.new_group(ranks)) for ranks in
                           ([s + i * stride for i in range(size)] for s in starts)]
    return _SUBGROUPS[key]


def _my_group(size: int, stride: int = 1):
    """(process group, index in it) of this rank among groups of `size` ranks `stride` apart."""
    me = dist.get_rank()
    for ranks, group in _subgroups(size, stride):
        if me in ranks:
            return group, ranks.index(me)
    raise AssertionError("rank in no group")


# ---------------------------------------------------------------- ring attention


def _ring_case(cp: int, causal: bool, kv_heads: int, seq: int, layout: str):
    group, rank = _my_group(cp)
    collectives.bind_groups(cp=group)
    try:
        gen = torch.Generator().manual_seed(1)
        full = [torch.randn(2, heads, seq, 8, generator=gen, requires_grad=True)
                for heads in (4, kv_heads, kv_heads)]
        expected = F.scaled_dot_product_attention(*full, is_causal=causal,
                                                  enable_gqa=kv_heads != 4)
        grad_out = torch.randn(expected.shape, generator=gen)
        expected.backward(grad_out)
        mine = lambda t: shard_sequence(t.detach(), cp, rank, dim=2, layout=layout)  # noqa: E731
        q, k, v = (mine(t).requires_grad_() for t in full)
        before = collectives.TRAFFIC[("p2p", "attn")]
        out = ring_attention(q, k, v, "cp", causal=causal, layout=layout, tag="attn")
        out.backward(mine(grad_out))
        sent = collectives.TRAFFIC[("p2p", "attn")] - before
        checks = [(out, expected), (q.grad, full[0].grad), (k.grad, full[1].grad),
                  (v.grad, full[2].grad)]
        return [(got.detach(), mine(want)) for got, want in checks], sent, k.numel() * 4
    finally:
        collectives.bind_groups(cp=None)


@pytest.mark.dist
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_ring_attention_matches_full_attention(pool4, cp, causal, kv_heads):
    seq = 2 * cp * 3   # chunks of 3 tokens: odd sizes, nothing a power of two
    for pairs, sent, kv_bytes in pool4.run(_ring_case, cp, causal, kv_heads, seq, "zigzag"):
        for name, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
        # K and V go round twice (cp - 1 hops each way), the fp32 dK/dV accumulators cp hops.
        assert sent == 2 * (cp - 1) * 2 * kv_bytes + cp * 2 * kv_bytes


@pytest.mark.dist
def test_ring_attention_contiguous_layout(pool4):
    for pairs, _, _ in pool4.run(_ring_case, 4, True, 2, 12, "contiguous"):
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- whole models


def make_optimizer(params):
    """SGD with momentum, as the trainer's comparisons use: linear in the gradient, so fp32
    summation-order noise stays noise."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _config(model: str, attention: str, layers: int | None):
    return get_config(model, attention=attention, global_batch=4, layers=layers)


def _reference(config, steps: int):
    """One process, the whole batch: losses, gradients of every step, final parameters."""
    torch.manual_seed(0)
    model = build_model(config)
    opt = make_optimizer(list(model.parameters()))
    batch = example_batch(config, config.global_batch)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def _average(tensor: torch.Tensor, groups) -> torch.Tensor:
    """Mean over the ranks of every group in turn (cp, then dp)."""
    for group, size in groups:
        if size > 1:
            dist.all_reduce(tensor, group=group)
            tensor /= size
    return tensor


def _average_grads(params: list[torch.nn.Parameter], groups) -> None:
    """All gradients as one flat tensor: one all-reduce per group instead of one per parameter."""
    flat = _average(torch.cat([p.grad.reshape(-1) for p in params]), groups)
    for p, part in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(part.view_as(p.grad))


def _cp_worker(model_name: str, attention: str, layers: int | None, cp: int, steps: int):
    """This rank's share of the batch: rows of its dp index, tokens of its cp index."""
    config = _config(model_name, attention, layers)
    dp = dist.get_world_size() // cp
    cp_group, cp_rank = _my_group(cp)
    dp_group, dp_rank = _my_group(dp, stride=cp) if dp > 1 else (None, 0)
    torch.manual_seed(0)
    model = build_model(config)
    tokens, targets = (t.chunk(dp)[dp_rank] for t in example_batch(config, config.global_batch))
    captured = capture(model, (tokens, targets))
    blocks = {layer.name: layer.nodes for layer in captured.blocks}
    gm = context_parallel(captured.gm, blocks, cp, cp_rank)
    local = [shard_sequence(t, cp, cp_rank) for t in (tokens, targets)]
    collectives.bind_groups(cp=cp_group)
    groups = [(cp_group, cp), (dp_group, dp)]
    opt = make_optimizer(list(gm.parameters()))
    losses, grads = [], []
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = gm(*local)
            loss.backward()
            _average_grads(list(gm.parameters()), groups)
            grads.append({k: p.grad.clone() for k, p in gm.named_parameters()})
            opt.step()
            losses.append(_average(loss.detach().clone(), groups).item())
    finally:
        collectives.bind_groups(cp=None)
    state = {k: p.detach().clone() for k, p in gm.named_parameters()}
    return (losses, grads, state) if dist.get_rank() == 0 else (losses, None, None)


@pytest.mark.dist
@pytest.mark.parametrize("model,attention,layers,cp", [
    ("gpt-tiny", "sdpa", None, 8), ("llama-tiny", "sdpa", None, 8),
    # cp 4 x dp 2; two blocks keep the written-out form's s x s scores cheap on two cores
    ("gpt-tiny", "math", 2, 4), ("llama-tiny", "math", 2, 4)])
def test_context_parallel_training_matches_one_process(pool8, model, attention, layers, cp):
    results = pool8.run(_cp_worker, model, attention, layers, cp, STEPS)
    ref_losses, ref_grads, ref_state = _reference(_config(model, attention, layers), STEPS)
    losses, grads, state = results[0]
    for other, _, _ in results[1:]:
        assert other == losses            # every rank reports the same global loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for step, (got, want) in enumerate(zip(grads, ref_grads)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")

