"""Context parallel on real gloo ranks against one process: ring attention, then whole models.

Attention: each rank holds its zig-zag share of q, k, v; the ring output and (dq, dk, dv) must equal
F.scaled_dot_product_attention of the full sequence (then sharded the same way) within 1e-5.
Models: plans with cp > 1 (alone and with tp, sp, recompute, pp and dp) trained through
autoparallelize's path (planner.training.local.run_parallel); per-step losses, gradients and final parameters
must equal the same model trained on the whole batch in one process.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cost_model.hardware.cluster import get_cluster
from cost_model.layers.layer_cost import price, profile_layer
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from passes.stages.program import Layout, rank_programs
from planner.api import plan
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import assert_same_run, reference_run, run_parallel
from runtime.comm import collectives
from runtime.comm import instrument
from runtime.programs.token_split import shard_sequence
from runtime.comm.mesh import Mesh, mesh_groups
from runtime.context.ring_attention import ring_attention
from tests.harness.positions import PositionSpec

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

# (dp, tp, pp, cp, block strategy, micro-batch size): CP alone, TP+CP, CP+PP+DP, and TP+SP with
# selective recompute under CP and PP. Micro-batches are few: every one costs 2·(cp−1) ring hops
# per layer, which on two cores is what a case's time is made of.
CP_MESHES = [(1, 1, 1, 8, "none", 8), (1, 2, 1, 4, "tp", 8), (2, 1, 2, 2, "none", 2),
             (1, 2, 2, 2, "tp+sp+sel", 4)]


@pytest.mark.dist
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dp,tp,pp,cp,strategy,mb", CP_MESHES)
def test_context_parallel_plan_matches_one_process(pool8, model, dp, tp, pp, cp, strategy, mb):
    config = get_config(model, layers=4, global_batch=8)  # two blocks a stage at pp=2
    chosen = plan(config, 8, cluster="cpu-gloo",
                  fix={"dp": dp, "tp": tp, "pp": pp, "cp": cp, "mb": mb, "strategy": strategy})[0]
    assert (chosen.dp, chosen.tp, chosen.pp, chosen.cp) == (dp, tp, pp, cp)
    assert_same_run(run_parallel(config, chosen, STEPS, pool8), reference_run(config, STEPS))


@pytest.mark.dist
def test_odd_shards_with_rotary_positions(pool8):
    """Sequence 24 over cp=4 is zig-zag chunks of 3 tokens, and sequence parallel over tp=2 then
    holds 3 of each rank's 6: odd sizes everywhere, rotary tables read at global positions."""
    config = get_config("llama-tiny", layers=2, seq=24, global_batch=8)
    chosen = plan(config, 8, cluster="cpu-gloo",
                  fix={"dp": 1, "tp": 2, "pp": 1, "cp": 4, "mb": 4, "strategy": "tp+sp"})[0]
    assert_same_run(run_parallel(config, chosen, STEPS, pool8), reference_run(config, STEPS))


@pytest.mark.dist
def test_written_out_attention_under_context_parallel(pool8):
    """softmax(q kᵀ) v written out (masked_fill causal mask) becomes ring attention too."""
    config = get_config("gpt-tiny", attention="math", layers=2, global_batch=8)
    chosen = plan(config, 8, cluster="cpu-gloo",
                  fix={"dp": 2, "tp": 1, "pp": 1, "cp": 4, "mb": 4})[0]
    assert_same_run(run_parallel(config, chosen, STEPS, pool8), reference_run(config, STEPS))


@pytest.mark.dist
@pytest.mark.parametrize("form", ["arange(0, t)", "pos[:t]"])
def test_positions_sized_by_the_input_train_as_in_one_process(pool2, form):
    """nanoGPT's wpe(arange(0, t)) and a learned table sliced [:t], t = tokens.shape[1] (a graph
    value, at run time each rank's t/cp): under cp=2 each rank reads its tokens' global
    positions, and training equals one process."""
    spec = PositionSpec(form)
    model, batch = spec.build()
    assert capture(model, batch).method == "symbolic_trace"   # t stays a graph value
    chosen = plan(model, 2, batch, cluster="cpu-gloo",
                  fix={"dp": 1, "tp": 1, "pp": 1, "cp": 2})[0]
    assert_same_run(run_parallel(spec, chosen, STEPS, pool2), reference_run(spec, STEPS))


def _ring_traffic(model: str, tp: int, cp: int, mb: int, strategy: str):
    """Bytes each layer sends (once, and again in recomputation) over one forward and backward of
    a tp x cp program."""
    config = get_config(model, layers=2)
    batch = tuple(x[:mb] for x in example_batch(config, mb))
    groups = mesh_groups(Mesh(1, 8 // (tp * cp), tp, cp))
    captured = capture(build_model(config), batch)
    layout = Layout(tp, tuple((b.name, strategy) for b in captured.blocks),
                    (len(captured.layers),), cp=cp)
    program = rank_programs(captured, layout, groups.tp_index, (0,), groups.cp_index)[0]
    local = [shard_sequence(x, cp, groups.cp_index) for x in batch]
    with instrument.counting() as traffic:
        program.gm(*local).backward()
    return traffic


@pytest.mark.dist
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("strategy", ["tp", "tp+sel"])
def test_counted_ring_traffic_equals_cost_model(pool8, model, strategy):
    """Per layer and collective kind, what a rank sends under tp=2 x cp=4 is what price() says;
    selective recompute runs the forward ring again, counted apart."""
    tp, cp, mb = 2, 4, 2
    config = get_config(model, layers=2)
    captured = capture(build_model(config), tuple(x[:mb] for x in example_batch(config, mb)))
    profile = profile_layer(captured, captured.blocks[0], tp)
    cost = price(profile, Strategy.parse(strategy), mb, get_cluster("cpu-gloo"), tp, cp)
    assert dict(cost.comm_bytes)["p2p"] > 0
    for traffic in pool8.run(_ring_traffic, model, tp, cp, mb, strategy):
        for block in captured.blocks:
            assert traffic.layer(block.name) == dict(cost.comm_bytes), block.name
            assert traffic.layer(block.name, repeated=True) == dict(cost.repeated_bytes), block.name
