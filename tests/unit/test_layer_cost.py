"""Layer profiles against published and hand counts.

Activation memory per GPT layer is checked against Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2), bytes for a 16-bit model with dropout:

  no parallelism                  sbh(34 + 5as/h)
  tensor parallel                 sbh(10 + 24/t + 5as/(ht))
  tensor + sequence parallel      sbh/t · (34 + 5as/h)
  tensor parallel + selective     sbh(10 + 24/t)
  tensor + sequence + selective   sbh · 34/t
  full recompute                  2sbh

FLOPs of a Llama-style layer (grouped-query attention, SwiGLU, RMSNorm) are checked against a
count by hand of every op the layer runs. Communication beyond the tensor-parallel all-reduces
(sequence-parallel gradient sums and re-gathers, recomputed collectives, vocabulary-parallel ends)
is checked against a count by hand here and against counted traffic in tests/dist/test_passes.py.
"""
import pytest
import torch

from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.comm import bytes_on_wire
from cost_model.layers.layer_cost import price, profile_layer
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from planner.models.presets import ModelConfig, build_model, get_config

CLUSTER = get_cluster("a100-80g-dgx")
TOLERANCE = 0.05

# GPT-3 175B at t = 8, and a small layer whose hidden size equals its sequence length, so that a
# [b, s, h] tensor has the [..., s, s] shape of attention scores and must not be taken for them.
CONFIGS = {
    "gpt3-175b": (get_config("gpt3-175b").with_(layers=1, dropout=0.1, attention="math"), 8),
    "small-h-eq-s": (ModelConfig("gpt", 1, 256, 8, 512, 256, dropout=0.1, attention="math"), 4),
}


def korthikanti(cfg: ModelConfig, strategy: Strategy, t: int) -> float:
    """Bytes per layer from Korthikanti et al. 2022, Table 2 (b = 1)."""
    s, h, a, b = cfg.seq, cfg.hidden, cfg.heads, 1
    sbh, core = s * b * h, 5 * a * s / h
    if strategy.recompute == "full":
        return 2 * sbh / (t if strategy.sp else 1)
    if not strategy.tp:
        return sbh * (34 + core)
    kept_core = 0 if strategy.recompute == "selective" else core / t
    if strategy.sp:
        return sbh * (34 / t + kept_core)
    return sbh * (10 + 24 / t + kept_core)


def _capture(cfg: ModelConfig):
    model = build_model(cfg, device="meta", dtype=torch.bfloat16)
    tokens = torch.zeros(1, cfg.seq, dtype=torch.long, device="meta")
    return capture(model, (tokens, tokens))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gpt_layer(request):
    cfg, t = CONFIGS[request.param]
    captured = _capture(cfg)
    block = captured.blocks[0]
    return cfg, t, {1: profile_layer(captured, block), t: profile_layer(captured, block, t)}


STRATEGIES = ["none", "tp", "tp+sp", "tp+sel", "tp+sp+sel", "full", "tp+full", "tp+sp+full"]


@pytest.mark.parametrize("text", STRATEGIES)
def test_gpt_activations_match_korthikanti(gpt_layer, text):
    cfg, t, profiles = gpt_layer
    strategy = Strategy.parse(text)
    tp = t if strategy.tp else 1
    ours = price(profiles[tp], strategy, 1, CLUSTER, tp).act_bytes
    want = korthikanti(cfg, strategy, t)
    assert ours == pytest.approx(want, rel=TOLERANCE), f"{text}: {ours / want - 1:+.2%}"


def test_activations_scale_with_micro_batch(gpt_layer):
    cfg, t, profiles = gpt_layer
    one = price(profiles[t], Strategy(True, True), 1, CLUSTER, t).act_bytes
    assert price(profiles[t], Strategy(True, True), 3, CLUSTER, t).act_bytes == pytest.approx(3 * one)


def test_selective_recompute_reruns_only_the_attention_core(gpt_layer):
    """The recomputed FLOPs are QKᵀ plus the per-score ops on the [b, a, s, s] scores."""
    cfg, _, profiles = gpt_layer
    s, h, a = cfg.seq, cfg.hidden, cfg.heads
    plain = price(profiles[1], Strategy(), 1, CLUSTER)
    selective = price(profiles[1], Strategy(recompute="selective"), 1, CLUSTER)
    qk = 2 * s * s * h
    # scale (1), causal mask (1), softmax (5), dropout (2) FLOPs per score: op_rules' conventions.
    per_score = (1 + 1 + 5 + 2) * a * s * s
    assert selective.flops - plain.flops == pytest.approx(qk + per_score)


def test_zb_h1s_second_traversal_is_the_backward_less_its_weight_half(gpt_layer):
    """retraverse_share = 1 - dW/B (the executor's default ZB-H1 split runs I + W = (1 + it)·B):
    dW is one product per weight matmul, 2 FLOPs per multiply-add of the block's 12h² weights per
    position (a count by hand; the attention's products of activations have none), B the
    backward, with full recompute the forward again."""
    cfg, _, profiles = gpt_layer
    weights = 2 * 12 * cfg.hidden ** 2 * cfg.seq
    plain = price(profiles[1], Strategy(), 1, CLUSTER)
    full = price(profiles[1], Strategy(recompute="full"), 1, CLUSTER)
    forward = full.flops - full.model_flops  # what full recompute runs again
    backward = plain.model_flops - forward
    assert (1 - plain.retraverse_share) * backward == pytest.approx(weights, rel=1e-3)
    assert (1 - full.retraverse_share) * (backward + forward) == pytest.approx(weights, rel=1e-3)
    assert 0.45 < plain.retraverse_share < full.retraverse_share < 0.75


# ---------------------------------------------------------------- Llama-style layer FLOPs

LLAMA = ModelConfig("llama", 1, 256, 8, 512, 64, kv_heads=2, ffn=384, attention="math")


def llama_forward_flops(cfg: ModelConfig, b: int = 1) -> tuple[float, float]:
    """(all forward FLOPs, matmul part) of one Llama layer, counted op by op.

    Matmuls: 2·M·N·K each.  Other ops, per element (op_rules' conventions): RMSNorm 4 (square,
    sum, scale by rstd, weight), SiLU 4, mul/add/neg/masked_fill 1, softmax 5, cat and
    repeat_interleave 0 (data movement)."""
    s, h, a, d, f = cfg.seq, cfg.hidden, cfg.heads, cfg.head_dim, cfg.ffn_hidden
    kv = cfg.n_kv_heads * d
    tokens = b * s
    matmul = (2 * tokens * h * (h + 2 * kv)       # q, k, v projections (GQA: k, v are kv wide)
              + 2 * 2 * b * a * s * s * d        # QKᵀ and attention over values, all query heads
              + 2 * tokens * h * h               # output projection
              + 3 * 2 * tokens * h * f)          # gate, up, down
    norms = 2 * 4 * tokens * h
    # x·cos + cat(-x2, x1)·sin on q and k: two multiplies and an add, a negate of half.
    rotary = 3.5 * tokens * (h + kv)
    scores = (1 + 1 + 5) * b * a * s * s         # scale, causal mask, softmax
    mlp = (4 + 1) * tokens * f                   # silu(gate) * up
    residuals = 2 * tokens * h
    return matmul + norms + rotary + scores + mlp + residuals, matmul


def test_llama_layer_flops_equal_a_hand_count():
    captured = _capture(LLAMA)
    profile = profile_layer(captured, captured.blocks[0])
    total, matmul = llama_forward_flops(LLAMA)
    assert sum(op.matmul_flops for op in profile.ops) == matmul
    assert sum(op.fwd_flops for op in profile.ops) == pytest.approx(total, rel=1e-12)
    # Narayanan et al.: backward is twice the forward, for every op of a non-fused layer.
    assert sum(op.bwd_flops for op in profile.ops) == pytest.approx(2 * total, rel=1e-12)


def test_llama_tensor_parallel_shards_every_matmul():
    captured = _capture(LLAMA)
    t = 2  # divides the two kv heads, so k and v shard too
    one, sharded = (profile_layer(captured, captured.blocks[0], tp) for tp in (1, t))
    assert sum(op.matmul_flops for op in sharded.ops) * t == sum(op.matmul_flops for op in one.ops)


# ---------------------------------------------------------------- communication


def test_sequence_parallel_sums_norm_gradients_and_gathers_again(gpt_layer):
    """tp+sp all-reduces the gradients of the replicated h-vectors (two norms' weights and biases,
    the two biases added after a reduce-scatter) whatever the batch, and gathers each
    column-parallel block's input again in backward (half the all-gather bytes)."""
    cfg, t, profiles = gpt_layer
    one, two = (price(profiles[t], Strategy(True, True), b, CLUSTER, t) for b in (1, 2))
    sums = bytes_on_wire("all_reduce", 6 * cfg.hidden * 2, t)  # bf16
    assert dict(one.comm_bytes)["all_reduce"] == dict(two.comm_bytes)["all_reduce"] == sums
    assert dict(one.repeated_bytes) == {"all_gather": dict(one.comm_bytes)["all_gather"] / 2}
    assert dict(price(profiles[t], Strategy(True), 1, CLUSTER, t).repeated_bytes) == {}


def test_full_recompute_reruns_the_forward_collectives_up_to_its_last_saved_tensor(gpt_layer):
    """Checkpointing stops recomputing at the last tensor saved: with dropout after the MLP that
    is past both forward all-reduces, so both run again; selective recompute reruns none."""
    cfg, t, profiles = gpt_layer
    plain, full, sel = (price(profiles[t], Strategy(True, recompute=r), 1, CLUSTER, t)
                        for r in ("none", "full", "selective"))
    assert full.comm_bytes == plain.comm_bytes == sel.comm_bytes
    assert dict(full.repeated_bytes) == {"all_reduce": dict(plain.comm_bytes)["all_reduce"] / 2}
    assert sel.repeated_bytes == ()
    assert full.comm_s > plain.comm_s == sel.comm_s


def test_vocab_parallel_ends_shard_the_padded_vocabulary():
    cfg = ModelConfig("gpt", 1, 64, 4, 250, 32)  # 250 = 4·62 + 2: padded to 4·63 rows
    h, s, t = cfg.hidden, cfg.seq, 4
    captured = _capture(cfg)
    ends = {layer.kind: layer for layer in captured.layers if layer.kind != "block"}
    one, four = ({k: profile_layer(captured, layer, tp) for k, layer in ends.items()}
                 for tp in (1, t))
    for kind in ("embed", "head"):  # the token table / the logits projection: 63 rows each
        assert one[kind].params - four[kind].params == (250 - 63) * h
    embed, head = (price(four[k], Strategy(tp=True), 1, CLUSTER, t) for k in ("embed", "head"))
    # embed: the looked-up rows summed forward; head: its input's gradient summed backward, and
    # the loss's row maximum, sum of exponentials and target logit (fp32) forward.
    assert dict(embed.comm_bytes) == {"all_reduce": bytes_on_wire("all_reduce", s * h * 2, t)}
    assert dict(head.comm_bytes) == {
        "all_reduce": bytes_on_wire("all_reduce", s * h * 2, t) + 3 * bytes_on_wire(
            "all_reduce", s * 4, t)}
    matmul = sum(op.matmul_flops for op in four["head"].ops)
    assert matmul == 2 * s * h * 63


# ---------------------------------------------------------------- measured per-element and per-op


def _llama_block_profile():
    cfg = get_config("llama-tiny")
    captured = capture(build_model(cfg, device="meta"),
                       (torch.zeros(2, cfg.seq, dtype=torch.long, device="meta"),) * 2)
    return profile_layer(captured, captured.blocks[0])


def test_norms_and_strided_ops_are_priced_per_element_when_measured():
    """RMSNorm's CPU backward runs far slower than its bytes say, and rotary's halves of a
    head-major view run element by element: with the per-element seconds measured, each such
    op takes at least elements x rate; unmeasured (0, the presets), the roofline alone."""
    import dataclasses

    from cost_model.hardware.compute import op_seconds
    profile = _llama_block_profile()
    norms = [op for op in profile.ops if op.per_element == "rms_norm"]
    strided = [op for op in profile.ops if op.per_element == "strided"]
    assert len(norms) == 2 and all(op.op_class == "norm" for op in norms)
    # rotary on q and k: a multiply, the negated half, the concatenation and the sum read
    # the transposed heads; the attention output's flatten copies a transposed tensor
    assert len(strided) >= 5 and all(op.op_class == "elementwise" for op in strided)
    cpu = get_cluster("cpu-gloo")
    measured = dataclasses.replace(cpu, rms_norm_fwd=1e-8, rms_norm_bwd=5e-8, strided_fwd=2e-8,
                                   strided_bwd=3e-8)
    for op, fwd, bwd in [(norms[0], 1e-8, 5e-8), (strided[0], 2e-8, 3e-8)]:
        assert op_seconds(op, 4.0, measured, False) == pytest.approx(4 * op.elements * fwd)
        assert op_seconds(op, 4.0, measured, True) == pytest.approx(4 * op.elements * bwd)
        assert op_seconds(op, 4.0, cpu, True) < op_seconds(op, 4.0, measured, True)
    matmul = next(op for op in profile.ops if op.op_class == "matmul")
    assert op_seconds(matmul, 4.0, measured, True) == op_seconds(matmul, 4.0, cpu, True)


def test_every_op_costs_the_measured_overhead_per_pass_whatever_the_batch():
    import dataclasses
    profile = _llama_block_profile()
    cpu = get_cluster("cpu-gloo")
    base = {mb: price(profile, Strategy(), mb, cpu) for mb in (1, 8)}
    over = {mb: price(profile, Strategy(), mb, dataclasses.replace(cpu, op_overhead=1e-6))
            for mb in (1, 8)}
    for mb in (1, 8):
        assert over[mb].fwd_s - base[mb].fwd_s == pytest.approx(len(profile.ops) * 1e-6)
        assert over[mb].bwd_s - base[mb].bwd_s == pytest.approx(len(profile.ops) * 1e-6)
