"""The tensor-parallel dataflow check (passes.rewrite.tp_dataflow): layers whose column-parallel outputs
meet an op that looks across the sharded dimension are refused, with the reason; the models the
rewrite is known to run exactly are accepted at every tp their heads allow."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.trace import capture
from planner.api import plan
from planner.search.costs import ModelCosts, PlanningError
from planner.models.presets import build_model, get_config

HIDDEN, VOCAB, SEQ = 32, 64, 8


class _Chain(nn.Module):
    """embedding, blocks of one kind, head, loss: the shape fxpar plans."""

    def __init__(self, block, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class RoutedBlock(nn.Module):
    """A mixture-of-experts MLP: a router's softmax weighs the experts' outputs."""

    def __init__(self, experts: int = 2):
        super().__init__()
        self.router = nn.Linear(HIDDEN, experts)
        self.up = nn.ModuleList(nn.Linear(HIDDEN, 2 * HIDDEN) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(2 * HIDDEN, HIDDEN) for _ in range(experts))

    def forward(self, x):
        gates = F.softmax(self.router(x), dim=-1)
        out = x
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            out = out + gates[..., e:e + 1] * down(F.gelu(up(x)))
        return out


class GatedSoftmaxBlock(nn.Module):
    """A softmax over hidden features that two column-parallel linears make together: no one
    linear to gather whole."""

    def __init__(self):
        super().__init__()
        self.up, self.gate = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.down(F.softmax(self.up(x) * self.gate(x), dim=-1))


class HalfBlock(nn.Module):
    """A column-parallel linear whose output leaves the block unreduced."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.fc(x)


class NormedHiddenBlock(nn.Module):
    """A LayerNorm over the MLP's hidden features (sharded under tp) before the down projection."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = (nn.Linear(HIDDEN, 64), nn.LayerNorm(64),
                                         nn.Linear(64, HIDDEN))

    def forward(self, x):
        return x + self.down(self.norm(self.up(x)))


class HeadBiasBlock(nn.Module):
    """Attention with a trained bias per head (ALiBi-like) held whole on every rank."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.bias = nn.Parameter(torch.zeros(heads, SEQ, SEQ))

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (-1, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return x + self.proj(y.transpose(1, 2).flatten(2))


class AllHeadsNormBlock(nn.Module):
    """Attention whose q and k are RMS-normalised over all heads' features (OLMo-2), with
    `kv_heads` key/value heads of width 8."""

    def __init__(self, kv_heads: int = 4):
        super().__init__()
        self.q, self.proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.k, self.v = nn.Linear(HIDDEN, 8 * kv_heads), nn.Linear(HIDDEN, 8 * kv_heads)
        self.q_weight = nn.Parameter(torch.ones(HIDDEN))
        self.k_weight = nn.Parameter(torch.ones(8 * kv_heads))

    def forward(self, x):
        def norm(t, weight):
            return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

        q, k = norm(self.q(x), self.q_weight), norm(self.k(x), self.k_weight)
        q, k, v = (t.unflatten(-1, (-1, 8)).transpose(1, 2) for t in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.proj(y.transpose(1, 2).flatten(2))


def test_a_norm_over_all_heads_is_summed_over_the_group():
    """The statistics of a norm over all heads' features are summed over the tp group and its
    weight is cut like the features; kv heads that each rank selects from a whole projection
    overlap, so a norm over them is refused."""
    costs = _costs(_Chain(AllHeadsNormBlock))
    for tp in (2, 4):
        profile = costs.block_profile(tp)
        assert profile is not None, costs.tp_errors.get(tp)
        # each way: the block's all-reduce of [1, SEQ, HIDDEN] fp32 and each norm's of [1, SEQ, 1]
        for phase in ("fwd", "bwd"):
            assert sorted(c.nbytes for c in profile.collectives if c.phase == phase) == [
                4 * SEQ, 4 * SEQ, 4 * SEQ * HIDDEN]
    costs = _costs(_Chain(lambda: AllHeadsNormBlock(kv_heads=1)))
    assert costs.block_profile(2) is None
    assert "not known to be disjoint blocks" in costs.tp_errors[2]


class AlibiBlock(nn.Module):
    """BLOOM's eager attention: batch and heads merged, scores = bias + q @ k^T (baddbmm)."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = (t.unflatten(-1, (-1, HIDDEN // self.heads)).transpose(1, 2).flatten(0, 1)
                   for t in self.qkv(x).chunk(3, -1))
        scores = torch.baddbmm(bias, q, k.transpose(1, 2)).view(b, self.heads, s, s)
        probs = scores.softmax(-1).view(b * self.heads, s, s)
        y = torch.bmm(probs, v).view(b, self.heads, s, -1).transpose(1, 2).flatten(2)
        return x + self.proj(y)


class AlibiChain(_Chain):
    """The bias, one slope per head, built before the blocks as [batch x heads, 1, seq]; from a
    trained parameter when `learned`."""

    def __init__(self, learned: bool = False, heads: int = 4):
        super().__init__(lambda: AlibiBlock(heads))
        self.heads = heads
        self.slopes = nn.Parameter(torch.ones(heads)) if learned else None

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        slopes = self.slopes if self.slopes is not None else \
            0.5 ** torch.arange(1, self.heads + 1, dtype=torch.float32)
        bias = (slopes[:, None] * torch.arange(SEQ)).repeat(tokens.shape[0], 1)[:, None, :]
        for block in self.blocks:
            x = block(x, bias)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("batch", [1, 2])
def test_a_bias_per_head_is_read_per_rank(batch):
    """Batch and heads merged into one dimension keep each rank's heads in every batch row; a
    bias computed from constants before the blocks is then read per rank with no communication,
    one computed from a trained parameter through tp_copy, whose backward all-reduces the bias
    ([batch x heads, 1, seq] fp32) so that each rank's part of its gradient is summed."""
    tokens = torch.zeros(batch, SEQ, dtype=torch.long)
    bias_bytes = 4 * batch * 4 * SEQ
    grads = {}
    for learned in (False, True):
        costs = ModelCosts(capture(AlibiChain(learned=learned), (tokens, tokens)), 3, 4)
        for tp in (2, 4):
            assert costs.block_profile(tp) is not None, costs.tp_errors.get(tp)
        grads[learned] = sorted(c.nbytes for c in costs.block_profile(2).collectives
                                if c.phase == "bwd")
    assert grads[True] == sorted(grads[False] + [bias_bytes])


def test_a_trained_bias_per_head_given_to_attention_is_read_per_rank():
    """A trained parameter per head as SDPA's additive mask (T5's position bias is one made from
    an embedding) is read through tp_copy, then each rank's heads of it."""
    costs = _costs(_Chain(HeadBiasBlock))
    for tp in (2, 4):
        profile = costs.block_profile(tp)
        assert profile is not None, costs.tp_errors.get(tp)
        assert 4 * 4 * SEQ * SEQ in [c.nbytes for c in profile.collectives if c.phase == "bwd"]


def _costs(model) -> ModelCosts:
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    captured = capture(model, (tokens, tokens))
    return ModelCosts(captured, len(captured.blocks), 4)


@pytest.mark.parametrize("block,words", [
    (GatedSoftmaxBlock, "reduces or normalises over the sharded dimension"),
    (HalfBlock, "leaves the layer"),
    (NormedHiddenBlock, "normalises over the sharded dimension"),
])
def test_layers_that_tp_would_get_wrong_are_refused(block, words):
    costs = _costs(_Chain(block))
    assert costs.block_profile(2) is None
    assert words in costs.tp_errors[2] and "not tensor-parallel" in costs.tp_errors[2]


def test_a_routers_logits_are_gathered_whole():
    """A router's softmax over the experts reads its linear's output whole: the router is cut
    by output features and all-gathered ([1, SEQ, 4] fp32), the experts' linears stay
    column- and row-parallel; a router of experts that tp does not divide stays whole on every
    rank (no all-gather)."""
    costs = _costs(_Chain(lambda: RoutedBlock(experts=4)))
    for tp in (2, 4):
        assert costs.block_profile(tp) is not None, costs.tp_errors.get(tp)
    fwd = [(c.kind, c.nbytes) for c in costs.block_profile(2).collectives if c.phase == "fwd"]
    assert ("all_gather", 4 * SEQ * 4) in fwd, fwd
    costs = _costs(_Chain(lambda: RoutedBlock(experts=2)))
    profile = costs.block_profile(4)
    assert profile is not None, costs.tp_errors.get(4)
    assert not any(c.kind == "all_gather" for c in profile.collectives), profile.collectives


def test_refused_tp_names_the_reason_when_fixed_and_in_the_notes_when_free():
    model = _Chain(GatedSoftmaxBlock)
    batch = tuple(torch.randint(0, VOCAB, (8, SEQ)) for _ in "xy")
    with pytest.raises(PlanningError, match="softmax"):
        plan(model, 2, batch, cluster="cpu-gloo", fix={"tp": 2})
    chosen = plan(model, 2, batch, cluster="cpu-gloo")[0]
    assert chosen.tp == 1
    assert any("softmax" in note for note in chosen.notes)


@pytest.mark.parametrize("config", [
    get_config("gpt-tiny"), get_config("gpt-tiny", attention="math"), get_config("llama-tiny"),
    get_config("llama-tiny", attention="math"), get_config("llama-tiny", kv_heads=2),
    get_config("llama-tiny", kv_heads=1),
])
def test_models_the_rewrite_runs_exactly_are_accepted(config):
    costs = _costs_of(config)
    for tp in (2, 4, 8):
        assert costs.block_profile(tp) is not None, costs.tp_errors.get(tp)


def _costs_of(config) -> ModelCosts:
    tokens = torch.zeros(1, config.seq, dtype=torch.long)
    captured = capture(build_model(config), (tokens, tokens))
    return ModelCosts(captured, len(captured.blocks), 4)


def test_hugging_face_blocks_are_accepted():
    hf = pytest.importorskip("planner.models.hf")
    pytest.importorskip("transformers")
    for arch in ("gpt2", "llama"):
        model = hf.build_hf(arch)
        tokens = torch.zeros(1, hf.sequence_length(model), dtype=torch.long)
        captured = capture(model, (tokens, tokens))
        costs = ModelCosts(captured, len(captured.blocks), 4)
        for tp in (2, 4):
            assert costs.block_profile(tp) is not None, costs.tp_errors.get(tp)


class FusedMQABlock(nn.Module):
    """One kv head fused with the queries: split into sized parts (GPT-BigCode's c_attn), or
    sliced out of a view (not a split the rewrite knows how to read per rank)."""

    def __init__(self, sliced: bool = False, heads: int = 4):
        super().__init__()
        self.heads, self.dim, self.sliced = heads, HIDDEN // heads, sliced
        self.c_attn = nn.Linear(HIDDEN, HIDDEN + 2 * self.dim)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.c_attn(x)
        if self.sliced:
            parts = fused.view(b, s, self.heads + 2, self.dim)
            q, k, v = parts[:, :, :-2], parts[:, :, -2:-1], parts[:, :, -1:]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:
            q, k, v = fused.unsqueeze(1).split((HIDDEN, self.dim, self.dim), dim=3)
            q = q.view(b, s, -1, self.dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.proj(y.transpose(1, 2).flatten(2))


def test_queries_fused_with_one_kv_head_are_read_per_rank_from_their_split():
    costs = _costs(_Chain(FusedMQABlock))
    for tp in (2, 4):
        assert costs.block_profile(tp) is not None, costs.tp_errors.get(tp)
    costs = _costs(_Chain(lambda: FusedMQABlock(sliced=True)))
    assert costs.block_profile(2) is None
    assert "fused with the queries' in a way not split by sized parts" in costs.tp_errors[2]



def test_a_view_merging_the_batch_with_the_heads_is_refused_from_two_samples():
    """XGLM's attention merges the heads with the batch by constant sizes: one sample's capture
    shows bsz x heads as the heads alone and accepts tp; the planner checks the rewrite on two
    samples' capture too, so tp is refused at plan time rather than by the run's rewrite."""
    pytest.importorskip("transformers")
    from planner.api import _model_costs
    from planner.training.local import HFSpec, build
    torch.manual_seed(0)
    model, batch = build(HFSpec("xglm", global_batch=4, seq=SEQ))
    one = _model_costs(model, tuple(x[:1] for x in batch), None, None)[0]
    assert one.block_profile(2) is not None  # what one sample shows
    with pytest.raises(PlanningError, match="merged dimensions"):
        plan(model, 2, batch, cluster="cpu-gloo", fix={"tp": 2})
    assert plan(model, 2, batch, cluster="cpu-gloo")[0].tp == 1
