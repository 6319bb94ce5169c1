"""The rewrite passes in one process: graph structure, local shapes, errors, recompute numerics.

(Numerics of tensor and sequence parallelism need real groups: tests/dist/test_passes.py.)
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from cost_model.hardware.comm import KINDS
from cost_model.layers.layer_cost import profile_layer
from passes.capture.trace import capture
from passes.stages.program import Layout, rank_programs, rewrite
from passes.capture.trace import propagate_shapes
from passes.rewrite.sharding import ShardingError, ShardSpec, shard_specs, tag_layers
from passes.rewrite.tensor_parallel import tensor_parallel
from passes.rewrite.vocab_parallel import vocab_parallel
from planner.models.presets import build_model, example_batch, get_config
from runtime.comm import instrument


def _captured(name: str, batch: int = 2, **changes):
    config = get_config(name, layers=2, **changes)
    torch.manual_seed(0)
    model = build_model(config)
    return model, capture(model, example_batch(config, batch))


def _layout(captured, tp: int, block: str, ends: str = "none", stages=None, pad=False) -> Layout:
    strategies = tuple((l.name, block if l.kind == "block" else ends) for l in captured.layers)
    return Layout(tp, strategies, stages or (len(captured.layers),), pad_vocab=pad)


def _calls(gm: fx.GraphModule) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes]


def test_tensor_parallel_names_its_collectives_and_shards_weights():
    _, captured = _captured("gpt-tiny")
    gm = rewrite(captured, _layout(captured, 4, "tp", "tp"), tp_rank=1)
    calls = _calls(gm)
    assert calls.count("tp_copy") == 5 and calls.count("tp_all_reduce") == 5  # 2 per block + ends
    assert "vocab_parallel_cross_entropy" in calls and "cross_entropy" not in calls
    specs = shard_specs(gm)
    assert specs["blocks.0.attn.qkv.weight"] == ShardSpec(0, 4, 1, chunks=3)
    assert specs["blocks.0.fc2.weight"] == ShardSpec(1, 4, 1)
    assert gm.get_parameter("wte.weight").shape == (64, 64)   # vocab 256 / 4
    assert gm.get_parameter("lm_head.weight").shape == (64, 64)
    assert "tp_copy" in gm.print_readable(print_output=False)


def test_heads_that_do_not_divide_name_layer_dimension_and_divisor():
    _, captured = _captured("gpt-tiny", hidden=48, heads=6)
    with pytest.raises(ShardingError, match=r"layer blocks\.0: 6 query heads \(dim 1 of .*\) "
                                            r"are not divisible by tp=4"):
        rewrite(captured, _layout(captured, 4, "tp"), tp_rank=0)
    _, captured = _captured("gpt-tiny", hidden=48, heads=6)
    with pytest.raises(ShardingError, match="6 query heads"):  # the planner sees the same
        profile_layer(captured, captured.blocks[0], 4)


def test_vocabulary_that_does_not_divide_needs_padding():
    _, captured = _captured("gpt-tiny", vocab=250)
    layers = {l.name: l.nodes for l in captured.layers if l.kind != "block"}
    with pytest.raises(ShardingError, match=r"layer embed: wte.weight has a vocabulary of 250 "
                                            r"\(dim 0 of its weight\), not divisible by tp=4"):
        vocab_parallel(captured.gm, layers, tp=4, rank=0)
    _, captured = _captured("gpt-tiny", vocab=250)
    gm = rewrite(captured, _layout(captured, 4, "none", "tp", pad=True), tp_rank=3)
    assert gm.get_parameter("wte.weight").shape == (63, 64)    # 252 rows / 4, two of them padding
    assert shard_specs(gm)["lm_head.weight"] == ShardSpec(0, 4, 3, pad=2)


def test_shard_spec_padding_round_trip():
    full = torch.randn(250, 8)
    specs = [ShardSpec(0, 4, i, pad=2) for i in range(4)]
    shards = [s.take(full) for s in specs]
    assert [s.shape[0] for s in shards] == [63] * 4 and not shards[3][-2:].any()
    torch.testing.assert_close(specs[0].join(shards), full, rtol=0, atol=0)


def test_sequence_that_does_not_divide_is_an_error():
    _, captured = _captured("gpt-tiny", seq=30)
    with pytest.raises(ShardingError, match=r"layer blocks\.0: sequence length 30 \(dim 1 of .*\) "
                                            r"is not divisible by tp=4"):
        rewrite(captured, _layout(captured, 4, "tp+sp"), tp_rank=0)


def test_sequence_parallel_boundaries_carry_local_shapes():
    _, captured = _captured("llama-tiny")
    layout = _layout(captured, 4, "tp+sp", stages=(2, 2))
    programs = rank_programs(captured, layout, tp_rank=2, stages=(0, 1))
    assert [s.shape for s in programs[0].output_specs] == [(2, 8, 128)]  # seq 32 / 4
    assert [s.shape for s in programs[1].input_specs] == [(2, 8, 128)]
    calls = _calls(programs[0].gm) + _calls(programs[1].gm)
    assert {"sp_scatter", "sp_gather_linear", "sp_reduce_scatter", "sp_gather"} <= set(calls)
    assert "tp_copy" not in calls and "tp_all_reduce" not in calls
    for program in programs.values():  # the cost model's contract: known kinds
        for node in program.gm.graph.nodes:
            kind = getattr(node.target, "_fxpar_collective", None)
            assert kind is None or kind.removesuffix("_backward") in KINDS


def test_grouped_kv_heads_that_do_not_divide_are_replicated_and_selected():
    _, captured = _captured("llama-tiny", kv_heads=2)
    assert profile_layer(captured, captured.blocks[0], 4) is not None  # the planner agrees
    _, captured = _captured("llama-tiny", kv_heads=2)
    gm = rewrite(captured, _layout(captured, 4, "tp"), tp_rank=3)
    narrows = [n for n in gm.graph.nodes if n.target is torch.narrow and n.meta["fxpar_layer"] ==
               "blocks.0" and n.args[1] == -1]
    assert [n.args[2:] for n in narrows] == [(8, 8), (8, 8)]  # q heads 12-15 read kv head 1
    assert gm.get_parameter("blocks.0.attn.k_proj.weight").shape == (16, 128)
    assert _calls(gm).count("tp_grad_sum") == 4  # k and v weights of 2 blocks


def _recompute_matches(name: str, block: str, **changes):
    model, captured = _captured(name, **changes)
    batch = example_batch(get_config(name, layers=2, **changes), 2)
    expected = model(*batch)
    expected.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    program = rank_programs(captured, _layout(captured, 1, block), 0, (0,))[0]
    loss = program.gm(*batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    got = dict(program.gm.named_parameters())
    assert got.keys() == want.keys()
    for key, grad in want.items():
        torch.testing.assert_close(got[key].grad, grad, rtol=1e-6, atol=1e-7)
    return program.gm


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_full_recompute_is_one_named_call_per_layer_and_exact(name):
    gm = _recompute_matches(name, "full")
    assert {"recompute_full_blocks_0", "recompute_full_blocks_1"} <= {
        n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert "checkpointed" in gm.print_readable(print_output=False)


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_selective_recompute_wraps_the_attention_core_exactly(attention):
    gm = _recompute_matches("gpt-tiny", "sel", attention=attention)
    body = gm.get_submodule("recompute_sel_blocks_0").body
    inner = _calls(body)
    if attention == "sdpa":
        assert "scaled_dot_product_attention" in inner
    else:
        assert "softmax" in inner and "masked_fill" in inner and "linear" not in " ".join(inner)


def test_saved_bytes_are_counted_per_layer_once_per_storage():
    _, captured = _captured("gpt-tiny")
    tag_layers(captured.gm, {l.name: l.nodes for l in captured.layers})
    batch = example_batch(get_config("gpt-tiny", layers=2), 2)
    loss, saved = instrument.saved_bytes(captured.gm, *batch)
    assert set(saved) == {"blocks.0", "blocks.1", "head"}  # embed keeps only token ids
    assert saved["blocks.0"] == saved["blocks.1"] > 0
    loss.backward()


def test_lifted_weights_are_made_parameters_and_sharded():
    def forward(x, w, b, w2):
        return F.linear(F.gelu(F.linear(x, w, b)), w2)

    gm = fx.symbolic_trace(forward)
    x, w, b, w2 = torch.randn(2, 3, 8), torch.randn(12, 8), torch.randn(12), torch.randn(8, 12)
    propagate_shapes(gm, (x, w, b, w2))
    names = [n.name for n in gm.graph.nodes if n.op != "output"]
    gm = tensor_parallel(gm, {"blocks.0": names}, tp=2, rank=1,
                         params={"w": w, "b": b, "w2": w2})
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    torch.testing.assert_close(gm.lifted_w, w[6:])
    torch.testing.assert_close(gm.lifted_b, b[6:])
    torch.testing.assert_close(gm.lifted_w2, w2[:, 6:])
    # No group bound: the collectives are identities, so this is rank 1's partial sum.
    partial = F.linear(F.gelu(F.linear(x, w, b))[..., 6:], w2[:, 6:])
    torch.testing.assert_close(gm(x), partial)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_context_parallel_reads_attention_dropout_that_tensor_parallel_made_per_rank(dropout):
    # tp turns a dropout of the sharded attention probabilities into runtime.training.rng.tp_dropout;
    # cp must still see it: skipped at p = 0, refused (by name) above
    from passes.rewrite.context_parallel import ContextParallelError
    from planner.models.presets import ModelConfig
    cfg = ModelConfig(arch="gpt", layers=1, hidden=8, heads=2, vocab=64, seq=8, attention="math",
                      global_batch=1, dropout=dropout)
    model = build_model(cfg).train()
    captured = capture(model, example_batch(cfg, 1))
    strategies = tuple((layer.name, "tp" if layer.kind == "block" else "none")
                       for layer in captured.layers)
    layout = Layout(2, strategies, (len(captured.layers),), cp=4)
    if dropout:
        with pytest.raises(ContextParallelError, match=r"attention dropout \(p=0.1\)"):
            rewrite(captured, layout, tp_rank=0, cp_rank=1)
    else:
        rewrite(captured, layout, tp_rank=0, cp_rank=1)
