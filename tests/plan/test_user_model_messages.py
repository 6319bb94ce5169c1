"""A user's own model planned with inputs or code fxpar cannot split: one clear line that says what
and how to fix it, never torch's internal text - a constant example input, tp+sp asked of inputs
declared not to be sequences, a reshape to sizes the tensor-parallel or sequence-parallel cut does
not follow - and no FutureWarning from torch's pytree when an exported graph is copied."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.trace import capture
from passes.rewrite.cp_trial import trial_error
from planner.api import plan
from planner.search.costs import PlanningError

TORCH_NOISE = ("While executing", "Original traceback", "tlparse", "https://")


class Attention(nn.Module):
    """Heads split with sizes read from the block input: `reshape(B, S, D)` merges them back to
    the full width, which tensor parallelism cuts (`merge="-1"` writes that dim as -1)."""

    def __init__(self, d=32, heads=4, merge="D"):
        super().__init__()
        self.h, self.merge = heads, merge
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, S, D = x.shape
        y = self.ln(x)
        width = (lambda t: t.shape[-1] // self.h) if self.merge == "part" else \
            (lambda t: D // self.h)
        q, k, v = (t.view(B, S, self.h, width(t)).transpose(1, 2)
                   for t in (f(y) for f in (self.q, self.k, self.v)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        a = a.reshape(B, S, -1 if self.merge == "-1" else D)
        return x + self.o(a)


class Tokens(nn.Module):
    def __init__(self, merge="D", vocab=50, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Attention(d, merge=merge) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, targets, label_smoothing=0.0):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten(),
                               label_smoothing=label_smoothing)


class Gated(nn.Module):
    """Feature vectors: a gate times the batch mean, per feature (no sequence anywhere)."""

    def __init__(self, d=16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gate = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(self.ln(x))))
        return h + self.gate * h.mean(0)


class Features(nn.Module):
    def __init__(self, d=16, layers=2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Gated(d) for _ in range(layers))
        self.out = nn.Linear(d, 4)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(h), y)


def _tokens(batch=8, seq=16, vocab=50):
    t = torch.randint(0, vocab, (batch, seq + 1))
    return t[:, :-1], t[:, 1:]


def _features(batch=8):
    return torch.randn(batch, 8), torch.randint(0, 4, (batch,))


def _one_line(message: str) -> str:
    assert "\n" not in message and not any(n in message for n in TORCH_NOISE), message
    return message


@pytest.mark.parametrize("constant, shown", [(0.1, "a float (0.1)"), (False, "a bool (False)")])
def test_a_constant_example_input_is_refused_naming_its_position_and_how_to_bind_it(
        constant, shown):
    with pytest.raises(ValueError) as err:
        plan(Tokens(), 2, (*_tokens(), constant), cluster="cpu-gloo")
    message = _one_line(str(err.value))
    for words in (f"example_inputs[2] (label_smoothing) is {shown}", "not a tensor",
                  "forward's default", "module attribute", "self.label_smoothing"):
        assert words in message, message


def test_inputs_not_sequences_plan_tensor_parallel_without_sequence_parallelism():
    # the block's per-feature mean once stopped the sequence-parallel rewrite with an IndexError
    best = plan(Features(), 2, _features(), cluster="cpu-gloo", sequence_dim=None,
                fix={"tp": 2})[0]
    strategies = [s for stage in best.stages for s in stage.strategies]
    assert best.tp == 2 and not any("sp" in s.split("+") for s in strategies), best
    with pytest.raises(ValueError) as err:
        plan(Features(), 2, _features(), cluster="cpu-gloo", sequence_dim=None,
             fix={"tp": 2, "strategy": "tp+sp"})
    message = _one_line(str(err.value))
    assert "sequence_dim=None says the inputs have none" in message, message
    assert "strategy='tp'" in message, message


def test_a_width_read_from_the_whole_block_input_becomes_the_rank_s_width():
    """timm's `reshape(B, S, D)` with D read from the block's input, which every rank holds
    whole: the rank's heads merge to D/tp (the literal the rewrite writes), as with -1."""
    for merge in ("D", "-1"):
        chosen = plan(Tokens(merge=merge), 2, _tokens(), cluster="cpu-gloo", fix={"tp": 2})[0]
        assert chosen.tp == 2 and not any("reshape" in n for n in chosen.notes), chosen.notes


def test_a_head_width_computed_from_the_rank_s_part_names_the_op_and_the_dim_to_write():
    """The head width taken from the projection's output (`t.shape[-1] // heads`, SD3's
    reference code) with a head count held by the module: on a rank that is the width of
    1/tp of a head - refused, naming the view and the dim to write as -1."""
    with pytest.raises(PlanningError) as err:
        plan(Tokens(merge="part"), 2, _tokens(), cluster="cpu-gloo", fix={"tp": 2})
    message = _one_line(str(err.value))
    for words in ("(view) in module 'blocks.0'", "does not follow the cut", "as -1"):
        assert words in message, message
    note = "\n".join(plan(Tokens(merge="part"), 2, _tokens(), cluster="cpu-gloo")[0].notes)
    assert "as -1" in note and not any(n in note for n in TORCH_NOISE), note


def test_under_sequence_parallelism_a_length_read_from_the_block_input_sizes_the_whole_sequence():
    """S read from the block's input - each rank's share of the sequence under sp - sizes views
    of the projections, which hold all of it: the rewrite writes the whole length there (a
    model of this kind trains exactly: tests/dist/test_user_structures.py, the hybrid)."""
    chosen = plan(Tokens(merge="-1"), 2, _tokens(), cluster="cpu-gloo",
                  fix={"tp": 2, "strategy": "tp+sp"})[0]
    blocks = {s for stage in chosen.stages for layer, s in zip(stage.layers, stage.strategies)
              if layer.startswith("blocks")}
    assert blocks == {"tp+sp"}, chosen.stages


def test_trying_context_parallel_on_an_exported_graph_warns_nothing_of_torch_pytree():
    class Block(nn.Module):  # nn.MultiheadAttention: captured by torch.export
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(self.attn(x, x, x, need_weights=False)[0])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.square().mean()

    captured = capture(Model(), (torch.randn(1, 8, 16),))
    assert captured.method == "export"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trial_error(captured.gm, {l.name: l.nodes for l in captured.layers})
    assert not [w for w in seen if "LeafSpec" in str(w.message)], [str(w.message) for w in seen]


class _SequenceOpBlock(nn.Module):
    """An MLP block whose output is then rolled, rotated by slices or summed along the sequence:
    per-token work it is not, so its shards under sequence parallelism are not the sequence."""

    def __init__(self, how: str, h: int = 16):
        super().__init__()
        self.how, self.norm = how, nn.LayerNorm(h)
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x):
        y = x + self.down(F.gelu(self.up(self.norm(x))))
        if self.how == "roll":
            return torch.roll(y, 1, 1)
        if self.how == "slices":
            return torch.cat([y[:, 1:], y[:, :1]], 1)
        return y.cumsum(1)


class _SequenceOpModel(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_SequenceOpBlock(how) for _ in range(2))

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("how, op, why", [
    ("roll", "roll", "works along the sequence"),
    ("slices", "getitem", r"gives \(1, 7, 16\) from add \(1, 8, 16\), the sequence \(dim 1\) "
                          r"changed"),
    ("cumsum", "cumsum", "works along the sequence")])
def test_sequence_parallel_refuses_an_op_that_is_not_per_token(how, op, why):
    """Sequence parallelism runs everything outside the tensor-parallel regions on each rank's
    tokens: an op along the sequence (a roll, a cumsum, slices joined again) would run on a
    shard and train to other numbers. Refused, naming the op; tp alone plans."""
    tokens = torch.randint(0, 32, (4, 8))
    with pytest.raises(PlanningError, match=rf"blocks\.0: {op} \({op}\) {why}.*strategy=tp\)"):
        plan(_SequenceOpModel(how), 2, (tokens, tokens), cluster="cpu-gloo",
             fix={"tp": 2, "strategy": "tp+sp"})
    plan(_SequenceOpModel(how), 2, (tokens, tokens), cluster="cpu-gloo",
         fix={"tp": 2, "strategy": "tp"})


class _EncoderDecoder(nn.Module):
    """A user's encoder-decoder of PyTorch's own layers: the encoder's output is read by every
    decoder layer (cross-attention), the decoder's token embedding is made before the encoder."""

    def __init__(self, h: int = 16, layers: int = 2):
        super().__init__()
        self.src, self.tgt = nn.Embedding(32, h), nn.Embedding(32, h)
        self.enc = nn.ModuleList(nn.TransformerEncoderLayer(h, 2, 2 * h, dropout=0.0,
                                                            batch_first=True)
                                 for _ in range(layers))
        self.dec = nn.ModuleList(nn.TransformerDecoderLayer(h, 2, 2 * h, dropout=0.0,
                                                            batch_first=True)
                                 for _ in range(layers))
        self.out = nn.Linear(h, 32)

    def forward(self, src, tgt, targets):
        memory = self.src(src)
        for layer in self.enc:
            memory = layer(memory)
        x = self.tgt(tgt)
        for layer in self.dec:
            x = layer(x, memory)
        return F.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


def test_values_carried_past_the_next_layer_are_said_in_the_plan():
    src, tgt = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 6))
    chosen = plan(_EncoderDecoder(), 4, (src, tgt, tgt), cluster="cpu-gloo",
                  fix={"pp": 4, "dp": 1})[0]
    notes = "\n".join(chosen.notes)
    assert ("(of enc.1.norm2), [1, 8, 16] for one sample, made in enc.1, is read by dec.0-1: "
            "carried from enc.1's stage to every stage holding them") in notes, notes
    assert "(of tgt), [1, 6, 16] for one sample, made in embed, is read by dec.0: carried" in notes


def test_a_cross_attention_is_tensor_parallel_with_its_in_projection_cut_per_rank():
    """nn.TransformerDecoderLayer's cross-attention multiplies by pieces of in_proj_weight split
    in the graph (the query's rows, the key's and value's): the parameter is cut per part and
    the split per rank, so the decoder's blocks are tensor-parallel like the encoder's."""
    src, tgt = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 6))
    chosen = plan(_EncoderDecoder(), 2, (src, tgt, tgt), cluster="cpu-gloo",
                  fix={"tp": 2, "dp": 1, "pp": 1, "strategy": "tp"})[0]
    strategies = dict(zip(chosen.stages[0].layers, chosen.stages[0].strategies))
    assert strategies["enc.0"] == "tp" and strategies["dec.0"] == "tp", strategies
    assert not any("not tensor-parallel" in n for n in chosen.notes), chosen.notes


class _SlicedLinear(nn.Module):
    """A linear that multiplies by a slice of its parameter (`w[:out]`): a weight computed in
    the graph in a form fxpar does not cut."""

    def __init__(self, h: int, out: int):
        super().__init__()
        self.out, self.w = out, nn.Parameter(torch.randn(3 * out, h) * 0.1)

    def forward(self, x):
        return F.linear(x, self.w[:self.out])


class _SlicedWeight(nn.Module):
    def __init__(self, h: int = 16):
        super().__init__()
        self.embed = nn.Embedding(32, h)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm": nn.LayerNorm(h), "up": _SlicedLinear(h, 2 * h), "out": nn.Linear(2 * h, h)})
            for _ in range(2))
        self.head = nn.Linear(h, 32)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for b in self.blocks:
            x = x + b["out"](F.gelu(b["up"](b["norm"](x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_weight_computed_in_the_graph_is_named_in_the_refusal():
    tokens = torch.randint(0, 32, (4, 8))
    with pytest.raises(ValueError, match=r"behind it: linear multiplies by a weight computed "
                                         r"from blocks\.0\.up\.w in the graph"):
        plan(_SlicedWeight(), 2, (tokens, tokens), cluster="cpu-gloo",
             fix={"tp": 2, "dp": 1, "pp": 1, "strategy": "tp"})


class _EinsumBlock(nn.Module):
    """Attention over heads written as einsums, its sequence padded to a block of 16 and cut
    back (LongT5's local attention does both); or, with `flip`, the query's features reversed:
    an op that reads across heads."""

    def __init__(self, h: int = 16, heads: int = 4, flip: bool = False):
        super().__init__()
        self.heads, self.flip = heads, flip
        self.norm = nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm(x)
        q, k, v = (p(y).unflatten(-1, (self.heads, -1)) for p in (self.q, self.k, self.v))
        if self.flip:
            q = q.flatten(2).flip(-1).unflatten(-1, (self.heads, -1))
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, 16 - s)) for t in (q, k, v))
        scores = torch.einsum("...qhd,...khd->...hqk", q, k).softmax(-1)   # LongT5's form
        out = torch.einsum("bhqk,bkhd->bqhd", scores, v)[:, :s]
        return x + self.o(out.reshape(b, s, h))


def _einsum_model(flip: bool = False) -> nn.Module:
    from tests.harness.shared_block import ChainLM
    return ChainLM([_EinsumBlock(flip=flip) for _ in range(2)])


def test_einsum_attention_and_a_padded_sequence_are_tensor_parallel():
    tokens = torch.randint(0, 32, (4, 8))
    chosen = plan(_einsum_model(), 2, (tokens, tokens), cluster="cpu-gloo",
                  fix={"tp": 2, "dp": 1, "pp": 1, "strategy": "tp"})[0]
    assert set(chosen.stages[0].strategies[1:-1]) == {"tp"}, chosen.stages[0].strategies


def test_a_refusal_after_gathering_a_projection_says_why_it_was_gathered():
    """The flip reads across heads: the query projection is gathered whole instead, and then
    the attention meets whole queries with the keys' heads; the refusal of that says which op
    had the projection gathered."""
    tokens = torch.randint(0, 32, (4, 8))
    with pytest.raises(ValueError, match=r"einsum \(einsum\) combines a sharded value with pad, "
                                         r"whole .*'\.\.\.qhd.*; checked with blocks_0_q gathered whole, as "
                                         r"flip \(flip\) reads a value sharded"):
        plan(_einsum_model(flip=True), 2, (tokens, tokens), cluster="cpu-gloo",
             fix={"tp": 2, "dp": 1, "pp": 1, "strategy": "tp"})


class _SizeFromHidden(nn.Module):
    """Reads the batch size from a tensor it computed (the embedding's output) and uses it in
    the head: a size that cannot be read again without that tensor."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        b = x.shape[0]
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).reshape(b, -1, 32).flatten(0, 1), targets.flatten())


def test_a_size_read_from_an_input_is_read_again_by_each_layer_using_it():
    """A user's DiT reads its batch size at the top of forward; the blocks and the head use
    it. Each of their layers reads it again from the input, so no size crosses a layer."""
    from tests.harness.user_dits import UserDiTSpec
    model, batch = UserDiTSpec("pixart").build()
    captured = capture(model, batch)
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    for layer in captured.layers:
        inside = set(layer.nodes)
        for name in layer.nodes:
            for arg in by_name[name].all_input_nodes:
                if arg.op != "placeholder" and arg.name not in inside:
                    assert isinstance(arg.meta.get("val"), torch.Tensor), (layer.name, arg.name)
    plan(model, 2, batch, cluster="cpu-gloo", fix={"pp": 2, "dp": 1, "tp": 1})


def test_a_size_read_from_a_computed_tensor_in_another_layer_is_refused_naming_it():
    tokens = torch.randint(0, 32, (4, 8))
    with pytest.raises(ValueError, match=r"reshape, in layer head, reads a size of embed, a "
                                         r"tensor computed in layer embed: read the size inside "
                                         r"the layer that uses it"):
        capture(_SizeFromHidden(), (tokens, tokens))


def test_a_block_listed_several_times_is_said_in_the_plan():
    from tests.harness.shared_block import SharedBlocksSpec
    model, batch = SharedBlocksSpec().build()
    chosen = plan(model, 2, batch, cluster="cpu-gloo", fix={"pp": 2})[0]
    assert [layer for st in chosen.stages for layer in st.layers] == ["embed", "blocks.0", "head"]
    assert any(n.startswith("blocks holds 1 distinct of its 4 blocks") for n in chosen.notes)


class InBatchPairs(nn.Module):
    """A contrastive loss whose targets are computed from the logits' size: the trainer counts
    each micro-batch's targets from its inputs alone, which it cannot do here."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)

    def forward(self, x, y):
        logits = F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(y), dim=-1).T
        return F.cross_entropy(logits, torch.arange(logits.shape[0]))


def test_targets_computed_from_the_model_are_refused_at_plan_time():
    """Before, every rank failed at the first step with this reason; now the plan says it."""
    with pytest.raises(ValueError) as err:
        plan(InBatchPairs(), 2, (torch.randn(8, 8), torch.randn(8, 8)), cluster="cpu-gloo")
    message = str(err.value)
    assert "targets of loss" in message and "pass them to the model as an input" in message
    assert "\n" not in message


class BatchSizeMean(nn.Module):
    """A mean written as a sum divided by the batch size read from a shape; iterating over the
    chunks of a projection makes symbolic_trace fail, so the capture falls back to torch.export,
    which keeps that size as the example's constant."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, y):
        a, b = (torch.tanh(part) for part in self.proj(x).chunk(2, -1))
        for block in self.blocks:
            a = a + torch.tanh(block(a))
        err = (a * torch.sigmoid(b) - y).pow(2)
        return err.sum() / err.shape[0]


def test_a_batch_size_export_baked_into_the_loss_is_refused():
    """Before, every micro-batch's loss was divided by the captured example's batch (1)."""
    with pytest.raises(ValueError) as err:
        plan(BatchSizeMean(), 2, (torch.randn(8, 8), torch.randn(8, 8)), cluster="cpu-gloo")
    assert "torch.export keeps as a constant" in str(err.value) and ".mean()" in str(err.value)


class ChannelMixingConv(nn.Module):
    def __init__(self, d=16, groups=1):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.conv = nn.Conv1d(2 * d, 2 * d, 3, padding=1, groups=groups)

    def forward(self, x):
        return x + self.down(self.conv(self.up(x).transpose(1, 2)).transpose(1, 2))


@pytest.mark.parametrize("groups, planned", [(1, False), (2, False), (32, True)])
def test_only_a_depthwise_convolution_of_sharded_channels_is_tensor_parallel(groups, planned):
    """Each rank holds 1/tp of the channels: a convolution with one group per channel works on
    them alone (its weight cut with them), one that mixes channels is refused naming it."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)
            self.blocks = nn.ModuleList(ChannelMixingConv(groups=groups) for _ in range(2))

        def forward(self, tokens, targets):
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    if planned:
        chosen = plan(Model(), 2, _tokens(), cluster="cpu-gloo", fix={"tp": 2, "strategy": "tp"})
        assert chosen[0].tp == 2
        return
    with pytest.raises(PlanningError) as err:
        plan(Model(), 2, _tokens(), cluster="cpu-gloo", fix={"tp": 2, "strategy": "tp"})
    message = _one_line(str(err.value))
    for words in ("blocks_0_conv (Conv1d)", f"mixes the channels it convolves (groups={groups} "
                  "over 32 channels)", "only a depthwise convolution"):
        assert words in message, message


class _TwoHeads(nn.Module):
    """Two heads written out (no SDPA): q, k and v viewed as (heads, head_dim)."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, 2, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v
        return x + self.o(a.transpose(1, 2).reshape(b, n, -1))


class _Stack(nn.Module):
    def __init__(self, block, n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_heads_that_do_not_divide_over_tp_are_named_at_their_view():
    """Two heads viewed as (2, 16) have the shape of a fused projection's two parts of 16
    features; no part is taken apart after the view, so they are heads, and tp=4 would cut
    one: refused there, with the count, not at the matmul that would then contract over a
    cut head dimension."""
    x = torch.randn(2, 8, 32)
    with pytest.raises(PlanningError) as err:
        plan(_Stack(_TwoHeads), 4, (x, x), cluster="cpu-gloo",
             fix={"tp": 4, "strategy": "tp"}, loss_fn=F.mse_loss)
    assert "view (view) splits the sharded dimension (32 over tp=4) into 2 pieces of 16" in \
        str(err.value) and "2 do not divide over tp=4" in str(err.value), str(err.value)
    from planner.models.presets import get_config
    grouped = get_config("llama-tiny", layers=1, hidden=64, heads=8, kv_heads=2).with_(
        attention="math")
    with pytest.raises(PlanningError, match="unflatten_1 .* into 2 pieces of 8"):
        plan(grouped, 4, fix={"tp": 4, "strategy": "tp"})


class _Sampled(Tokens):
    """Tokens with a dropout after the embedding and a router-like sample in each block."""

    def __init__(self, p: float, sample: bool):
        super().__init__()
        self.drop, self.sample = nn.Dropout(p), sample
        if sample:
            for block in self.blocks:
                block.forward = self._noisy(block.forward)

    @staticmethod
    def _noisy(forward):
        return lambda x: forward(x + 1e-3 * torch.empty_like(x).exponential_())

    def forward(self, tokens, targets, label_smoothing=0.0):
        x = self.drop(self.emb(tokens))
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("p,sample,said", [
    (0.1, False, "(dropout in embed)"),
    (0.0, True, "(exponential in blocks.0, blocks.1)"),
    (0.0, False, None)])
def test_random_draws_in_the_forward_are_said_in_the_plan(p, sample, said):
    """Each rank draws its own numbers: the plan says where the model draws, and that runs
    match one process in distribution; a dropout of p = 0 draws nothing."""
    chosen = plan(_Sampled(p, sample), 2, _tokens(), cluster="cpu-gloo", fix={"dp": 2})[0]
    notes = [n for n in chosen.notes if n.startswith("the model draws random numbers")]
    if said is None:
        assert not notes, notes
    else:
        assert len(notes) == 1 and said in notes[0] and "in distribution" in notes[0], notes
