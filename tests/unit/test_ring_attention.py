"""Context parallel in one process: the zig-zag split, the blockwise attention the ring runs (every
rank's computation, with every K/V block at hand), and the graph rewrite."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from passes.capture.trace import capture, propagate_shapes
from passes.rewrite.context_parallel import POSITIONS_BUFFER, ContextParallelError, context_parallel
from planner.models.presets import build_model, example_batch, get_config
from runtime.programs.token_split import (chunk_ids, global_positions, shard_batch, shard_sequence,
                             unshard_sequence)
from runtime.context.ring_attention import Spec, backward_blocks, forward_blocks, ring_attention
from tests.harness.positions import (FORMS, SEQ, UNPROVABLE, VOCAB, WIDTH, PositionEmbed,
                                     PositionLM)

# ---------------------------------------------------------------- the split


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_unshard_inverts_shard(layout, cp):
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    shards = [shard_sequence(x, cp, r, dim=2, layout=layout) for r in range(cp)]
    assert all(s.shape == (2, 3, 24 // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards, dim=2, layout=layout), x)


def test_zigzag_pairs_opposite_chunks():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert global_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert global_positions(16, 4, 1, layout="contiguous").tolist() == [4, 5, 6, 7]
    tokens, targets = shard_batch([torch.arange(16).view(1, 16)] * 2, 4, 3)
    assert tokens.tolist() == targets.tolist() == [[6, 7, 8, 9]]


def test_sequence_must_divide_into_two_cp_chunks():
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2·cp = 8"):
        shard_sequence(torch.zeros(1, 12), 4, 0)
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by cp = 4"):
        shard_sequence(torch.zeros(1, 10), 4, 0, layout="contiguous")
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(torch.zeros(1, 16), 4, 0, layout="striped")
    with pytest.raises(ValueError, match="rank 4 is outside"):
        chunk_ids(4, 4)


def test_zigzag_balances_causal_work():
    """Per step, each rank computes the same area of scores (a diagonal block counts half)."""
    cp = 4
    spec = Spec(cp, "zigzag", causal=True, scale=1.0)
    for step in range(cp):
        work = {sum(0.5 if diag else 1.0 for *_, diag in spec.pairs(r, (r - step) % cp))
                for r in range(cp)}
        assert work == {2.0}   # chunk pairs: the same on every rank at every step


# ---------------------------------------------------------------- blockwise attention


def _emulate(q, k, v, grad_out, cp, causal, layout, mask=None):
    """Every rank's forward and backward over all K/V blocks in ring order; unsharded results.
    `mask`: the whole sequence's, of which each rank gets its query rows."""
    shard = lambda t: [shard_sequence(t, cp, r, dim=2, layout=layout) for r in range(cp)]  # noqa
    qs, ks, vs, gs = shard(q), shard(k), shard(v), shard(grad_out)
    rows = ([shard_sequence(mask, cp, r, dim=-2, layout=layout) for r in range(cp)]
            if mask is not None else [None] * cp)
    spec = Spec(cp, layout, causal, q.size(-1) ** -0.5, q.size(2) if mask is not None else 0)
    outs, dqs, dkv = [], [], [0] * cp
    for r in range(cp):
        blocks = [((r - t) % cp, torch.stack([ks[(r - t) % cp], vs[(r - t) % cp]]))
                  for t in range(cp)]
        out, lse = forward_blocks(qs[r], blocks, spec, r, rows[r])
        outs.append(out)
        settle = lambda source, grad: dkv.__setitem__(source, dkv[source] + grad)  # noqa: E731
        dqs.append(backward_blocks(gs[r], qs[r], out, lse, blocks, spec, r, settle, rows[r]))
    join = lambda xs: unshard_sequence(xs, dim=2, layout=layout)  # noqa: E731
    return join(outs), join(dqs), join([g[0] for g in dkv]), join([g[1] for g in dkv])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp,kv_heads", [(1, 4), (2, 2), (3, 4), (4, 1)])
def test_blockwise_attention_is_exact(layout, causal, cp, kv_heads):
    gen = torch.Generator().manual_seed(0)
    seq = 2 * cp * 3
    q, k, v = (torch.randn(2, h, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, kv_heads, kv_heads))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 4)
    grad_out = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected.backward(grad_out)
    got = _emulate(q.detach(), k.detach(), v.detach(), grad_out, cp, causal, layout)
    for g, want in zip(got, (expected, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, want.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("cp", [2, 3])
def test_blockwise_attention_with_an_explicit_mask_is_exact(layout, kind, cp):
    """Left padding (query rows that see no key get 0), a sliding window and causality in one
    mask per sample, boolean or added to the scores: equal to F.scaled_dot_product_attention."""
    gen = torch.Generator().manual_seed(0)
    seq = 2 * cp * 3
    q, k, v = (torch.randn(2, h, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    i, j = torch.arange(seq).view(-1, 1), torch.arange(seq)
    pads = torch.tensor([0, seq // 2 + 1]).view(2, 1, 1, 1)
    mask = (j <= i) & (j > i - 5) & (j >= pads)          # [2, 1, seq, seq]
    if kind == "float":
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    grad_out = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    expected.backward(grad_out)
    got = _emulate(q.detach(), k.detach(), v.detach(), grad_out, cp, False, layout, mask)
    for g, want in zip(got, (expected, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, want.detach(), rtol=1e-10, atol=1e-10)


def test_ring_attention_alone_is_attention():
    """Outside a process group (one rank holds everything) and on fake tensors: plain attention."""
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    torch.testing.assert_close(ring_attention(q, k, v, causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              enable_gqa=True))
    with FakeTensorMode() as mode:
        out = ring_attention(*(mode.from_tensor(t) for t in (q, k, v)), causal=True)
    assert out.shape == q.shape
    assert ring_attention._fxpar_collective == "ring_p2p"
    with pytest.raises(ValueError, match="heads dividing"):
        ring_attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))


# ---------------------------------------------------------------- the rewrite


def _captured(model: str, attention: str = "sdpa", **overrides):
    config = get_config(model, layers=2, attention=attention, **overrides)
    return capture(build_model(config), example_batch(config, 2))


def _blocks(captured):
    return {layer.name: layer.nodes for layer in captured.blocks}


def _rings(gm):
    return [n for n in gm.graph.nodes if n.target is ring_attention]


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_rewrite_uses_ring_attention_and_global_positions(model, attention):
    captured = _captured(model, attention)
    gm = context_parallel(captured.gm, _blocks(captured), cp=4, rank=1)
    rings = _rings(gm)
    assert [n.kwargs["tag"] for n in rings] == ["blocks.0", "blocks.1"]
    assert all(n.kwargs["causal"] and n.args[3] == "cp" for n in rings)
    kv_heads = get_config(model).n_kv_heads
    assert all(n.args[1].meta["val"].shape[1] == kv_heads for n in rings)  # not repeated
    left = [n.name for n in gm.graph.nodes
            if n.target in (F.scaled_dot_product_attention, F.softmax, torch.narrow)]
    assert left == []
    assert torch.equal(getattr(gm, POSITIONS_BUFFER), global_positions(32, 4, 1))
    selects = [n for n in gm.graph.nodes if n.target is torch.index_select]
    assert len(selects) == (1 if model == "gpt-tiny" else 4 * 2)
    assert rings[0].meta["val"].shape[2] == 32 // 4   # shapes re-propagated for local tokens


def test_one_rank_leaves_the_graph_alone():
    captured = _captured("gpt-tiny")
    before = captured.gm.code
    assert context_parallel(captured.gm, _blocks(captured), cp=1, rank=0).code == before


def test_sequence_not_divisible_is_an_error():
    captured = _captured("gpt-tiny", seq=24)
    with pytest.raises(ValueError, match="sequence length 24 is not divisible by 2·cp = 16"):
        context_parallel(captured.gm, _blocks(captured), cp=8, rank=0)


def test_attention_outside_the_layers_is_an_error():
    captured = _captured("llama-tiny")
    only_first = {"blocks.0": _blocks(captured)["blocks.0"]}
    with pytest.raises(ContextParallelError, match="in no layer given"):
        context_parallel(captured.gm, only_first, cp=2, rank=0)


def test_attention_dropout_is_an_error():
    captured = _captured("gpt-tiny", dropout=0.1)
    with pytest.raises(ContextParallelError, match=r"dropout.*F.scaled_dot_product_attention"):
        context_parallel(captured.gm, _blocks(captured), cp=2, rank=0)


class _BandAttention(nn.Module):
    """Written-out attention with a mask that is not causal: beyond what the ring can do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool).triu(2))

    def forward(self, x):
        q = k = v = x.unflatten(-1, (2, 4)).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)).masked_fill(self.mask, float("-inf"))
        return F.softmax(scores, dim=-1) @ v


def test_unrecognised_attention_names_the_sdpa_form():
    gm = fx.symbolic_trace(_BandAttention())
    propagate_shapes(gm, (torch.randn(1, 8, 8),))
    softmax = next(n.name for n in gm.graph.nodes if n.target is F.softmax)
    with pytest.raises(ContextParallelError, match="causal mask.*F.scaled_dot_product_attention"):
        context_parallel(gm, {"attn": [softmax]}, cp=2, rank=0)


class _LearntMask(nn.Module):
    """An sdpa mask added from a trained bias: not a function of inputs and positions."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8, 8))

    def forward(self, x):
        q = k = v = x.unflatten(-1, (2, 4)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias * 2)


def test_a_mask_computed_from_weights_is_refused():
    gm = fx.symbolic_trace(_LearntMask())
    propagate_shapes(gm, (torch.randn(1, 8, 8),))
    sdpa = next(n.name for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    with pytest.raises(ContextParallelError, match="depends on the model's weights"):
        context_parallel(gm, {"attn": [sdpa]}, cp=2, rank=0)


class _Causal(nn.Module):
    def forward(self, x):
        q = x[:, None]
        return x + F.scaled_dot_product_attention(q, q, q, is_causal=True)[:, 0]


class _ShiftedLM(nn.Module):
    """Labels shifted inside the graph, as Hugging Face causal LMs do (pad by one, drop the first)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Causal(), _Causal()])

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(self.head(x).flatten(0, 1), shifted.flatten(), ignore_index=-100)


def test_labels_shifted_inside_the_graph_are_refused():
    from passes.rewrite.context_parallel import why_not
    from planner.api import plan
    from planner.search.costs import PlanningError

    batch = (torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8)))
    captured = capture(_ShiftedLM(), batch)
    layers = {layer.name: layer.nodes for layer in captured.layers}
    assert "shifts the sequence" in why_not(captured.gm, layers)
    with pytest.raises(ContextParallelError, match="shifts the sequence"):
        context_parallel(captured.gm, layers, cp=2, rank=0)
    with pytest.raises(PlanningError, match="shifts the sequence.*; nearest legal cp: 1"):
        plan(_ShiftedLM(), 4, batch, cluster="cpu-gloo", fix={"cp": 2})
    assert plan(_ShiftedLM(), 4, batch, cluster="cpu-gloo")[0].cp == 1


@pytest.mark.parametrize("form", list(FORMS))
def test_positions_sized_by_the_input_read_this_ranks_global_positions(form):
    """An arange or a table's first rows sized by the input's length t (a graph value, at run
    time the rank's t/cp) reads the global positions of the rank's tokens, as one process does:
    at cp=4 rank 1 holds positions 1 and 6 of 8."""
    torch.manual_seed(0)
    model = PositionEmbed(form)
    batch = (torch.randint(0, VOCAB, (2, SEQ)), torch.randn(2, SEQ, WIDTH))
    captured = capture(model, batch)
    assert captured.method == ("export" if "exported" in form else "symbolic_trace")
    gm = context_parallel(captured.gm, {}, cp=4, rank=1)
    mine = [shard_sequence(x, 4, 1) for x in batch]
    want = (shard_sequence(model.embed(batch[0]), 4, 1) * mine[1]).sum()
    torch.testing.assert_close(gm(*mine), want)


@pytest.mark.parametrize("form", list(UNPROVABLE))
def test_positions_from_the_length_in_another_form_are_refused(form):
    """Computed from t but not provably the rank's positions (an offset, t read off a dim that
    batch = seq makes ambiguous): refused, not left to count from each rank's own t/cp."""
    batch = (torch.randint(0, VOCAB, (SEQ, SEQ)), torch.randn(SEQ, SEQ, WIDTH))
    gm = capture(PositionEmbed(form), batch).gm
    with pytest.raises(ContextParallelError, match="computed from the sequence length t but is "
                                                   "not a form context parallel rewrites"):
        context_parallel(gm, {}, cp=2, rank=0)


def test_positions_from_the_length_in_another_form_are_refused_at_plan_time():
    from planner.api import plan
    from planner.search.costs import PlanningError

    model = PositionLM("pos[1:t + 1]")
    batch = (torch.randint(0, VOCAB, (4, SEQ)), torch.randint(0, VOCAB, (4, SEQ)))
    assert capture(model, batch).method == "symbolic_trace"   # t stays a graph value
    with pytest.raises(PlanningError, match=r"getitem_\d+ = pos\[1:add\] is computed from the "
                                            r"sequence length"):
        plan(model, 2, batch, cluster="cpu-gloo", fix={"cp": 2})


def test_blocks_a_boolean_mask_hides_do_no_work(monkeypatch):
    """A causal mask given explicitly computes the blocks is_causal computes, no more."""
    from runtime.context import ring_attention as ring
    calls = []
    real = ring.block_forward
    monkeypatch.setattr(ring, "block_forward", lambda *a: calls.append(1) or real(*a))
    cp, seq = 2, 8
    q = k = v = torch.randn(1, 2, seq, 4, dtype=torch.float64)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    got = _emulate(q, k, v, torch.randn(1, 2, seq, 4, dtype=torch.float64), cp, False, "zigzag",
                   causal)[0]
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    pairs = Spec(cp, "zigzag", True, 1.0)
    assert len(calls) == sum(len(pairs.pairs(r, s)) for r in range(cp) for s in range(cp))
