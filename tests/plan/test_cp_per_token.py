"""Under context parallelism every op but attention must work token by token: a model that reads
across the sequence anywhere else (pooling, a [CLS] or last token, a softmax or cumulative sum
along it, a convolution or linear over it) is refused naming the op, not trained on each rank's
slice (passes.rewrite.cp_tokens). The same models with cp=1 plan, and a model that only moves the
sequence around (heads split and transposed, batch and sequence flattened for the loss) plans
with cp=2."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.api import plan

H, S, V = 16, 16, 32


class Block(nn.Module):
    def __init__(self, mix: str):
        super().__init__()
        self.mix = mix
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.conv = nn.Conv1d(H, H, 3, padding=1)
        self.over_tokens = nn.Linear(S, S)
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))

    def mixed(self, x):
        if self.mix == "mean":
            return x + x.mean(1, keepdim=True)
        if self.mix == "softmax":
            return x * torch.softmax(x, dim=1)
        if self.mix == "cumsum":
            return x + x.cumsum(1)
        if self.mix == "conv":
            return x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        if self.mix == "pool":  # a smoothing over neighbouring tokens
            return x + F.avg_pool1d(x.transpose(1, 2), 3, 1, 1).transpose(1, 2)
        if self.mix == "einsum-mixer":  # MLP-Mixer's token mixing by a [seq, seq] weight
            return x + torch.einsum("bld,lm->bmd", x, torch.eye(S))
        if self.mix == "fourier":  # FNet's token mixing
            return x + torch.fft.fft(torch.fft.fft(x, dim=-1), dim=-2).real
        if self.mix == "shift":  # RWKV's token shift: each token mixed with the one before
            return x + F.pad(x, (0, 0, 1, -1))
        if self.mix == "shift-module":
            return x + self.shift(x)
        if self.mix == "linear":
            return x + self.over_tokens(x.transpose(1, 2)).transpose(1, 2)
        return x

    def forward(self, x):
        x = self.mixed(x)
        if self.mix == "unbound":  # timm's split: q, k, v [batch, heads, seq, d] after unbind
            q, k, v = self.qkv(x).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True) + q.mean(2, True)
        elif self.mix == "einsum-scores":  # beside SDPA, attention written out: not ringed
            q, k, v = (t.unflatten(-1, (4, -1)) for t in self.qkv(x).chunk(3, -1))
            w = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
            y = torch.einsum("bhqk,bkhd->bhqd", w, v) + F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        elif self.mix.startswith("indexed"):  # q, k, v = qkv[0], qkv[1], qkv[2]: ints drop dim 0
            qkv = self.qkv(x).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y + q.mean(2, True) if self.mix == "indexed-mean" else y
        else:
            q, k, v = (t.unflatten(-1, (4, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).flatten(2))


class Model(nn.Module):
    def __init__(self, mix: str = "none", pool: str = "none"):
        super().__init__()
        self.pool = pool
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block(mix) for _ in range(2))
        self.head = nn.Linear(H, V)

    def forward(self, tokens, target):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        if self.pool == "none":
            return F.cross_entropy(self.head(x).flatten(0, 1), target.flatten())
        summary = {"mean": lambda: x.mean(1), "cls": lambda: x[:, 0],
                   "last": lambda: x[:, -1]}[self.pool]()
        return F.cross_entropy(self.head(summary), target[:, 0])


def _plan(model, cp: int):
    batch = (torch.randint(0, V, (4, S)), torch.randint(0, V, (4, S)))
    return plan(model, cp, batch, cluster="cpu-gloo", fix={"cp": cp, "dp": 1, "tp": 1, "pp": 1})


@pytest.mark.parametrize("mix, pool, words", [
    ("mean", "none", "mean (mean) reduces over the sequence"),
    ("softmax", "none", "works along the sequence"),
    ("cumsum", "none", "cumsum (cumsum) works along the sequence"),
    ("conv", "none", "convolves or pools along the sequence"),
    ("linear", "none", "contracts the sequence"),
    ("shift", "none", "pad (pad) pads or shifts the sequence"),
    ("pool", "none", "convolves or pools along the sequence"),
    ("fourier", "none", "transforms along the sequence"),
    ("einsum-mixer", "none", "contracts the sequence in an einsum (bld,lm->bmd"),
    ("einsum-scores", "none", "puts the positions of two sequences in one value (bqhd,bkhd"),
    ("shift-module", "none", "pads or shifts the sequence"),
    ("unbound", "none", "(mean) reduces over the sequence (dim 2 of getitem"),
    ("indexed-mean", "none", "(mean) reduces over the sequence (dim 2 of getitem"),
    ("none", "mean", "reduces over the sequence"),
    ("none", "cls", "takes some positions of the sequence"),
    ("none", "last", "takes some positions of the sequence"),
])
def test_reading_across_the_sequence_outside_attention_is_refused_under_cp(mix, pool, words):
    model = Model(mix, pool)
    with pytest.raises(ValueError) as err:
        _plan(model, 2)
    message = str(err.value)
    assert words in message and "plan with cp=1" in message and "\n" not in message
    assert _plan(model, 1)  # the same model plans without splitting the sequence


@pytest.mark.parametrize("mix", ["none", "indexed"])
def test_a_model_that_works_token_by_token_plans_under_cp(mix):
    assert _plan(Model(mix), 2)[0].cp == 2


@pytest.mark.parametrize("mix", ["shift", "shift-module", "fourier"])
def test_a_token_shift_is_refused_under_sequence_parallelism(mix):
    """Under tp+sp the shift (or FNet's Fourier transform) would run on each rank's tokens
    between the tensor-parallel regions: the block is refused sp (and planned tp), naming it."""
    batch = (torch.randint(0, V, (4, S)), torch.randint(0, V, (4, S)))
    with pytest.raises(ValueError) as err:
        plan(Model(mix), 2, batch, cluster="cpu-gloo",
             fix={"tp": 2, "dp": 1, "pp": 1, "strategy": "tp+sp"})
    assert "works along the sequence" in str(err.value), err.value
    chosen = plan(Model(mix), 2, batch, cluster="cpu-gloo", fix={"tp": 2, "dp": 1, "pp": 1})[0]
    assert chosen.tp == 2
