"""GPT-OSS's attention with sinks as torch.ops.fxpar.sink_attention (runtime.attention.sinks,
planner.models.hf_sinks): it equals transformers' eager attention under its own causal and
sliding-window masks (output and every gradient), so does the whole model's loss; other masks are
honoured, not dropped; it is captured as one node priced over the visible (query, key) pairs; the
tensor-parallel rewrite shards it by heads with its sinks, context parallelism refuses it."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

pytest.importorskip("transformers")

from cost_model.layers.layer_cost import profile_layer  # noqa: E402
from cost_model.ops.node_cost import node_cost  # noqa: E402
from cost_model.ops.rules import visible_pairs  # noqa: E402
from passes.capture.trace import capture, propagate_shapes  # noqa: E402
from passes.rewrite.context_parallel import why_not  # noqa: E402
from passes.rewrite.sharding import ShardingError, is_sink_attention  # noqa: E402
from passes.rewrite.tensor_parallel import tensor_parallel  # noqa: E402
from planner.models import hf_sinks  # noqa: E402
from planner.models.hf import HFCausalLM, from_config, small_config  # noqa: E402
from runtime.attention import sinks as ops  # noqa: E402

SEQ, WINDOW, HEADS, KV_HEADS, HEAD_DIM = 12, 4, 4, 2, 8


def _config():
    return small_config("gpt_oss", hidden_size=32, num_hidden_layers=2, head_dim=HEAD_DIM,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        sliding_window=WINDOW, intermediate_size=48, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=SEQ,
                        layer_types=["sliding_attention", "full_attention"])


def _models(dtype=torch.float32):
    """(fxpar's model, transformers' eager model) with the same weights."""
    import transformers
    torch.manual_seed(0)
    fused = from_config(_config())
    eager = HFCausalLM(transformers.AutoModelForCausalLM.from_config(
        _config(), attn_implementation="eager"))
    eager.load_state_dict(fused.state_dict())
    for model in (fused, eager):
        model.to(dtype)
        if dtype == torch.float64:  # grouped_mm has no float64: transformers' own loop instead
            model.model.config._experts_implementation = "eager"
    return fused, eager


def _eager_mask(config, sliding: bool, batch: int, dtype):
    """transformers' own mask for the eager attention of a full or a sliding layer."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    embeds = torch.zeros(batch, SEQ, config.hidden_size, dtype=dtype)
    return make(config=config, inputs_embeds=embeds, attention_mask=None, cache=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("rows", [None, 5], ids=["one-block", "blocks-of-5"])
def test_the_op_equals_transformers_eager_attention(dtype, layer, rows):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    _, eager = _models(dtype)
    module = eager.model.model.layers[layer].self_attn
    assert module.sliding_window == (WINDOW if layer == 0 else None)
    mask = _eager_mask(eager.model.config, layer == 0, 2, dtype)
    gen = torch.Generator().manual_seed(layer)
    q, k, v = (torch.randn(2, h, SEQ, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)
    grad = torch.randn(want.shape, generator=gen, dtype=dtype)
    wants = torch.autograd.grad(want, (q, k, v, module.sinks), grad)
    window = module.sliding_window or 0
    if rows is None:  # the op itself, through autograd
        got = ops.sink_attention(q, k, v, module.sinks, module.scaling, window)
        gots = torch.autograd.grad(got, (q, k, v, module.sinks), grad.transpose(1, 2))
    else:  # its blocks, smaller than the sequence and than window + rows
        got = ops.attend(q, k, v, module.sinks, module.scaling, window, rows=rows)
        gots = ops.attend_backward(grad.transpose(1, 2), q, k, v, module.sinks,
                                   module.scaling, window, rows=rows)
    torch.testing.assert_close(got.transpose(1, 2), want)
    for name, g, w in zip("q k v sinks".split(), gots, wants):
        torch.testing.assert_close(g, w, msg=name)


def test_the_whole_model_trains_as_transformers_eager_model():
    fused, eager = _models(torch.float64)
    assert fused.model.config._attn_implementation == hf_sinks.NAME
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 256, (2, SEQ), generator=gen) for _ in "xy")
    got, want = fused(tokens, targets), eager(tokens, targets)
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    expected = dict(eager.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, msg=name)


def test_a_padding_mask_is_honoured():
    """A mask the op does not apply itself runs transformers' eager attention on it."""
    fused, eager = _models(torch.float64)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[0, :3] = 0
    got = fused.model(input_ids=tokens, attention_mask=padding, use_cache=False).logits
    want = eager.model(input_ids=tokens, attention_mask=padding, use_cache=False).logits
    torch.testing.assert_close(got, want)
    plain = fused.model(input_ids=tokens, use_cache=False).logits
    assert not torch.allclose(got[0], plain[0])  # the padding changed something


def test_the_mask_function_drops_only_the_masks_the_op_applies():
    from transformers.masking_utils import (causal_mask_function, eager_mask,
                                            sliding_window_causal_mask_function)
    config = _config()
    sizes = dict(batch_size=1, q_length=SEQ, kv_length=SEQ, config=config, dtype=torch.float32)
    mask = hf_sinks.causal_or_eager_mask
    assert mask(mask_function=causal_mask_function, **sizes) is None
    assert mask(mask_function=sliding_window_causal_mask_function(WINDOW), **sizes) is None
    other = sliding_window_causal_mask_function(WINDOW + 1)  # not the window the layers apply
    torch.testing.assert_close(mask(mask_function=other, **sizes),
                               eager_mask(mask_function=other, **sizes))
    padding = torch.ones(1, SEQ, dtype=torch.bool)
    padding[0, 0] = False
    torch.testing.assert_close(
        mask(mask_function=causal_mask_function, attention_mask=padding, **sizes),
        eager_mask(mask_function=causal_mask_function, attention_mask=padding, **sizes))
    offset = {**sizes, "q_length": 1}  # decoding one token against a cache
    assert mask(mask_function=causal_mask_function, **offset) is not None


@pytest.mark.parametrize("seq,window", [(12, 0), (12, 4), (12, 12), (12, 20), (7, 1), (1, 3)])
def test_visible_pairs_count_the_mask(seq, window):
    positions = torch.arange(seq)
    assert visible_pairs(seq, window) == int(ops.visible(positions, positions, window).sum())


def test_captured_as_one_node_per_layer_priced_over_the_visible_pairs():
    fused, _ = _models()
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    captured = capture(fused, (tokens, tokens))
    nodes = [n for n in captured.gm.graph.nodes if is_sink_attention(n)]
    assert [n.args[5] for n in nodes] == [WINDOW, 0]
    modules = dict(captured.gm.named_modules())
    # by hand: a 4-token window sees 1 + 2 + 3 + 4 * 9 = 42 pairs of 12 tokens, causal 12 * 13 / 2
    for node, pairs in zip(nodes, (42, 78)):
        cost = node_cost(node, modules)
        assert cost.op_class == "attention" and cost.pairs == HEADS  # batch 1 x query heads
        assert cost.fwd_flops == 2 * HEADS * pairs * (HEAD_DIM + HEAD_DIM)
        assert cost.bwd_flops == 2.5 * cost.fwd_flops
        q, k, v = (x.meta["val"] for x in node.args[:3])
        kept = dict(cost.saved)
        assert kept[f"{node.name}:logsumexp"] == 4 * HEADS * SEQ
        assert sum(kept.values()) == (q.nbytes + k.nbytes + v.nbytes + q.nbytes
                                      + 4 * HEADS * SEQ)  # q, k, v, the output, the lse
    # the sliding and the full layer differ only in the window: two kinds of block, each priced
    # with its own attention
    assert len({block.signature for block in captured.blocks}) == 2
    for block in captured.blocks:  # and a block profiles whole at tp = 1
        profile = profile_layer(captured, block)
        assert sum(op.op_class == "attention" for op in profile.ops) == 1
    layers = {layer.name: list(layer.nodes) for layer in captured.layers}
    assert "no attention sinks" in why_not(captured.gm, layers)


class SinkBlock(nn.Module):
    """q/k/v projections, rotary-like halves of head_dim swapped, sink attention, projection:
    GPT-OSS's attention without its biases, so tp ranks' outputs sum to the whole one."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.q = nn.Linear(hidden, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(hidden, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(hidden, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, hidden, bias=False)
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        first, second = q.chunk(2, dim=-1)
        q = torch.cat([second, first], dim=-1)
        y = ops.sink_attention(q, k, v, self.sinks, HEAD_DIM ** -0.5, WINDOW)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("tp", [2, 4])  # 4: more ranks than kv heads, each selects its own
def test_tensor_parallel_shards_it_by_heads_and_cuts_the_sinks(tp):
    torch.manual_seed(0)
    block, x = SinkBlock(), torch.randn(2, SEQ, 32)
    whole = block(x)
    grad = torch.randn_like(whole)
    whole.backward(grad)
    outs, sink_grads = [], []
    for rank in range(tp):  # no group bound: each rank's collectives are identities
        gm = fx.symbolic_trace(copy.deepcopy(block))
        propagate_shapes(gm, (x,))
        names = [n.name for n in gm.graph.nodes if n.op != "output"]
        tensor_parallel(gm, {"blocks.0": names}, tp=tp, rank=rank)
        assert gm.sinks.shape == (HEADS // tp,)
        out = gm(x)
        out.backward(grad)
        outs.append(out)
        sink_grads.append(gm.sinks.grad)
    torch.testing.assert_close(sum(outs), whole)  # the row-parallel partial sums
    torch.testing.assert_close(torch.cat(sink_grads), block.sinks.grad)


def test_tensor_parallel_refuses_heads_it_cannot_divide():
    block, x = SinkBlock(), torch.randn(1, SEQ, 32)
    gm = fx.symbolic_trace(block)
    propagate_shapes(gm, (x,))
    names = [n.name for n in gm.graph.nodes if n.op != "output"]
    with pytest.raises(ShardingError, match="query heads"):
        tensor_parallel(gm, {"blocks.0": names}, tp=8, rank=0)
