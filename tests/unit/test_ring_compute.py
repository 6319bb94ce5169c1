"""Ring attention priced as runtime.context.ring_attention runs it: its traced block loops against a count
of the attention products by hand, the fused kernel it replaces left out under cp, and the
calibrated time per ring step."""
import dataclasses

import pytest
import torch

from cost_model.hardware.cluster import get_cluster
from cost_model.layers.layer_cost import price, profile_layer
from cost_model.ops.ring_attention import TRACED_GROUPS, RingShape, calls, ring_ops
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from planner.bench.ring_probe import ring_terms
from planner.models.presets import build_model, get_config

HEADS, KV_HEADS, SEQ, DIM = 4, 2, 32, 8


def _matmul_flops(ops) -> float:
    return sum(op.fwd_flops for op in ops if op.op_class == "matmul")


@pytest.mark.parametrize("cp", [2, 4])
def test_without_a_mask_every_block_pair_is_two_products_forward_and_five_backward(cp):
    """Each rank's queries meet every key: q·kᵀ and p·v over [local, seq] per query head forward;
    backward recomputes q·kᵀ and forms dv, dp, dq and dk."""
    f_ops, b_ops = ring_ops(RingShape(HEADS, KV_HEADS, SEQ, DIM, False, "", "torch.float32"), cp)
    group = HEADS // KV_HEADS
    product = 2 * TRACED_GROUPS * group * (SEQ // cp) * SEQ * DIM
    assert _matmul_flops(f_ops) == 2 * product
    assert _matmul_flops(b_ops) == 5 * product


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_zigzag_computes_the_chunks_below_and_on_the_diagonal(cp):
    """With 2·cp chunks in zig-zag order each rank holds chunks r and 2cp-1-r: together the
    ranks attend the C(C+1)/2 chunk pairs (a, b ≤ a) of C = 2cp chunks, the same share each."""
    f_ops, _ = ring_ops(RingShape(HEADS, KV_HEADS, SEQ, DIM, True, "", "torch.float32"), cp)
    chunks = 2 * cp
    pairs_per_rank = chunks * (chunks + 1) // 2 / cp
    chunk = SEQ // chunks
    group = HEADS // KV_HEADS
    assert _matmul_flops(f_ops) == 2 * 2 * TRACED_GROUPS * group * chunk * chunk * DIM * \
        pairs_per_rank


def test_a_boolean_mask_is_applied_to_every_block():
    plain = ring_ops(RingShape(HEADS, KV_HEADS, SEQ, DIM, False, "", "torch.float32"), 2)
    masked = ring_ops(RingShape(HEADS, KV_HEADS, SEQ, DIM, False, "torch.bool", "torch.float32"),
                      2)
    assert _matmul_flops(masked[0]) == _matmul_flops(plain[0])
    assert calls(masked[0]) > calls(plain[0]) and calls(masked[1]) > calls(plain[1])


def _llama_block():
    cfg = get_config("llama-tiny")
    captured = capture(build_model(cfg, device="meta"),
                       (torch.zeros(2, cfg.seq, dtype=torch.long, device="meta"),) * 2)
    return captured, profile_layer(captured, captured.blocks[0])


def test_the_layer_knows_the_attention_ring_attention_takes():
    cfg = get_config("llama-tiny")
    _, profile = _llama_block()
    assert profile.rings == (RingShape(cfg.heads, cfg.kv_heads, cfg.seq, cfg.hidden // cfg.heads,
                                       True, "", "torch.float32"),)
    ringed = [op for op in profile.ops if op.ringed]
    assert [op.op_class for op in ringed] == ["attention"]


def _measured():
    """A cluster whose runtime is measured (as `fxpar calibrate` writes on CPUs)."""
    return dataclasses.replace(get_cluster("cpu-gloo"), action_floor=1e-4)


def test_under_cp_the_fused_kernel_is_not_priced_but_the_rings_ops_are():
    """A fused attention far dearer changes the price of cp=1 and leaves cp=2's alone; the ring's
    own ops (elementwise passes over score blocks) are priced instead. A preset keeps pricing
    the fused kernel."""
    _, profile = _llama_block()
    preset = get_cluster("cpu-gloo")
    assert price(profile, Strategy(), 4, dataclasses.replace(preset, attention_overhead=1.0),
                 cp=2).fwd_s > price(profile, Strategy(), 4, preset, cp=2).fwd_s + 1
    cpu = _measured()
    dear = dataclasses.replace(cpu, attention_overhead=1.0)
    for cp in (1, 2):
        cheap, costly = price(profile, Strategy(), 4, cpu, cp=cp), price(profile, Strategy(), 4,
                                                                          dear, cp=cp)
        assert (costly.fwd_s > cheap.fwd_s + 1) == (cp == 1)
        assert (costly.bwd_s > cheap.bwd_s + 1) == (cp == 1)
    slow_pointwise = dataclasses.replace(cpu, pointwise_flops=1e6)
    assert price(profile, Strategy(), 4, slow_pointwise, cp=2).fwd_s > \
        price(profile, Strategy(), 4, slow_pointwise, cp=1).fwd_s


@pytest.mark.parametrize("cp", [2, 4])
def test_every_ring_step_costs_the_calibrated_time_per_pass(cp):
    _, profile = _llama_block()
    cpu = _measured()
    stepped = dataclasses.replace(cpu, ring_step_fwd=1e-3, ring_step_bwd=3e-3)
    base, more = price(profile, Strategy(), 4, cpu, cp=cp), price(profile, Strategy(), 4,
                                                                   stepped, cp=cp)
    assert more.fwd_s - base.fwd_s == pytest.approx(cp * 1e-3)
    assert more.bwd_s - base.bwd_s == pytest.approx(cp * 3e-3)
    assert price(profile, Strategy(), 4, stepped).fwd_s == price(profile, Strategy(), 4, cpu).fwd_s


def test_a_layer_without_attention_sends_nothing_round_a_ring():
    captured, _ = _llama_block()
    embed = profile_layer(captured, captured.layers[0])
    cost = price(embed, Strategy(), 4, get_cluster("cpu-gloo"), cp=2)
    assert dict(cost.comm_bytes).get("p2p", 0.0) == 0.0 and cost.comm_s == 0.0


def test_ring_terms_spread_the_excess_over_the_ring_steps_and_are_never_negative():
    assert ring_terms(0.010, 0.020, 0.006, 0.012, rings=2, cp=2) == pytest.approx(
        dict(ring_step_fwd=0.001, ring_step_bwd=0.002))
    assert ring_terms(0.005, 0.010, 0.006, 0.012, rings=2, cp=2) == dict(ring_step_fwd=0.0,
                                                                          ring_step_bwd=0.0)
