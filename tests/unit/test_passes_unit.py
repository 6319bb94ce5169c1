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


class _Lookup(torch.nn.Module):
    """An embedding whose ids are the token input after `ids` (traced inline)."""

    def __init__(self, ids):
        super().__init__()
        self.wte, self.ids = torch.nn.Embedding(16, 4), ids

    def forward(self, tokens):
        return self.wte(self.ids(tokens))


def _one_layer(gm: fx.GraphModule) -> dict[str, list[str]]:
    return {"embed": [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]}


@pytest.mark.parametrize("ids", [
    lambda t: t.view(-1, 8), lambda t: t.reshape(16), lambda t: t.flatten(),
    lambda t: torch.flatten(t, 0, 1), lambda t: t.unsqueeze(0).view(2, 8)],
    ids=["view", "reshape", "flatten", "torch.flatten", "unsqueeze+view"])
def test_a_lookup_of_reshaped_token_ids_is_split_over_the_vocabulary(ids):
    """GPT-2 and OPT look up input_ids.view(-1, seq): a re-shape keeps every id, so the lookup
    is a token embedding, split like one of the input as given - and exactly: the two ranks'
    masked slices (before their all-reduce) sum to the whole lookup."""
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _Lookup(ids)
    whole = model(tokens)
    parts = []
    for rank in range(2):
        gm = fx.symbolic_trace(model)
        vocab_parallel(gm, _one_layer(gm), tp=2, rank=rank, localize=False)
        assert gm.get_parameter("wte.weight").shape == (8, 4)
        parts.append(gm(tokens))  # no tp group bound: the all-reduce leaves the rank's part
    torch.testing.assert_close(parts[0] + parts[1], whole)


@pytest.mark.parametrize("ids,node", [
    (lambda t: t + 1, "add"), (lambda t: t % 16, "mod"), (lambda t: t.flip(-1), "flip"),
    (lambda t: t.view(-1, 8).clamp(0, 7), "clamp")],
    ids=["add", "mod", "flip", "clamp-after-view"])
def test_a_lookup_of_ids_changed_in_value_is_refused_naming_the_node(ids, node):
    """Anything but a re-shape between the token input and the lookup - an op that changes the
    ids' values or order - is not a token embedding to this rewrite: refused, the node named."""
    gm = fx.symbolic_trace(_Lookup(ids))
    layers = _one_layer(gm)
    with pytest.raises(ShardingError, match=rf"layer embed: not vocabulary-parallel: its "
                                            rf"embedding lookup \(wte\) takes ids computed "
                                            rf"from the inputs by {node} "):
        vocab_parallel(gm, layers, tp=2, rank=0, localize=False)


class _PaddedLookup(torch.nn.Module):
    """F.embedding with a padding row and optionally max_norm (as captured models call it)."""

    def __init__(self, padding_idx, max_norm=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 4))
        self.padding_idx, self.max_norm = padding_idx, max_norm

    def forward(self, tokens):
        return F.embedding(tokens, self.weight, self.padding_idx, self.max_norm)


@pytest.mark.parametrize("padding_idx", [0, 3, 8, 12, -1])
def test_a_split_lookup_keeps_the_padding_row_where_it_is(padding_idx):
    """The padding row gets no gradient; split over two ranks, it is a row of one shard only, at
    its local index there. Left at its global index, the other rank would drop the gradient of a
    real row (the one at that index in its shard): the ranks' gradients, side by side, are the
    whole lookup's."""
    tokens = torch.arange(16).repeat(2).view(2, 16)   # every id, so every row has a gradient
    torch.manual_seed(0)
    model = _PaddedLookup(padding_idx)
    model(tokens).pow(2).sum().backward()
    grads = []
    for rank in range(2):
        gm = fx.symbolic_trace(model)
        vocab_parallel(gm, _one_layer(gm), tp=2, rank=rank, localize=False)
        gm(tokens).pow(2).sum().backward()
        grads.append(gm.get_parameter("weight").grad)
    torch.testing.assert_close(torch.cat(grads), model.weight.grad)


def test_a_lookup_with_max_norm_is_not_split():
    """max_norm renormalises in place the rows a lookup reads, and a split lookup reads row 0
    of its shard for every id outside it: refused, naming the lookup."""
    gm = fx.symbolic_trace(_PaddedLookup(None, max_norm=1.0))
    with pytest.raises(ShardingError, match="embedding looks up with max_norm=1.0"):
        vocab_parallel(gm, _one_layer(gm), tp=2, rank=0, localize=False)


def test_gpt2_tied_ends_split_as_one_weight():
    """Hugging Face GPT-2 captured by torch.export: wte(input_ids.view(-1, seq)) and lm_head
    tied to wte, read through one name (lm_head.weight) while wte.weight stays an unused
    get_attr. Both ends vocabulary-parallel at tp=2: every name of the tied weight is this rank's
    one shard, which the ranks' runtime keeps one parameter (runtime.training.tied)."""
    pytest.importorskip("transformers")
    from planner.api import _capture
    from planner.models.loss import with_loss
    from planner.training.local import HFSpec, build
    model, batch = build(HFSpec("gpt2", global_batch=2, seq=32))
    captured = _capture(with_loss(model, None), tuple(x[:1] for x in batch))
    gm = rewrite(captured, _layout(captured, 2, "none", "tp"), tp_rank=1)
    wte = gm.get_parameter("model.transformer.wte.weight")
    assert wte is gm.get_parameter("model.lm_head.weight")
    assert wte.shape == (128, 64) and wte.fxpar_shard == ShardSpec(0, 2, 1)
    calls = _calls(gm)
    assert "vocab_parallel_cross_entropy" in calls and calls.count("tp_all_reduce") == 1


def test_shard_spec_padding_round_trip():
    full = torch.randn(250, 8)
    specs = [ShardSpec(0, 4, i, pad=2) for i in range(4)]
    shards = [s.take(full) for s in specs]
    assert [s.shape[0] for s in shards] == [63] * 4 and not shards[3][-2:].any()
    torch.testing.assert_close(specs[0].join(shards), full, rtol=0, atol=0)


def test_shard_spec_of_unequal_parts_round_trip():
    """Phi-3's fused q, k, v of 8, 4 and 4 rows: each rank holds its block of every part."""
    full = torch.arange(16.0).view(16, 1)
    specs = [ShardSpec(0, 2, i, sizes=(8, 4, 4)) for i in range(2)]
    shards = [s.take(full) for s in specs]
    assert shards[1].flatten().tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    torch.testing.assert_close(specs[0].join(shards), full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="takes no chunks or padding"):
        ShardSpec(0, 2, 0, pad=2, sizes=(8, 8))


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
