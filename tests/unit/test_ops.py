"""Per-op costs: Narayanan et al. 2021 FLOPs and Korthikanti et al. 2022 saved bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from cost_model.ops import fallback as op_fallback
from cost_model.ops.fallback import UnpricedOpWarning
from cost_model.ops.node_cost import OpCost, node_cost, saved_node_name

BF16 = torch.bfloat16
S, B, H, A = 16, 2, 64, 4  # sequence, batch, hidden, heads


# ---------------------------------------------------------------- helpers


def fake_trace(model: nn.Module, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(x) for x in inputs])
    return gm


def costs(gm: torch.fx.GraphModule) -> dict[str, OpCost]:
    modules = dict(gm.named_modules())
    return {n.name: node_cost(n, modules) for n in gm.graph.nodes}


def saved_total(cs: dict[str, OpCost]) -> float:
    """Saved bytes deduplicated by name, as the layer aggregator does."""
    kept: dict[str, float] = {}
    for c in cs.values():
        for name, size in c.saved:
            kept.setdefault(name, size)
    return sum(kept.values())


def matmul_total(cs: dict[str, OpCost]) -> float:
    return sum(c.matmul_flops for c in cs.values())


def meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def on_meta(cls: type[nn.Module], *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return cls(*args, **kwargs).to(BF16)


# ---------------------------------------------------------------- models


class Attention(nn.Module):
    """GPT attention written out: q@k^T, scale, causal mask, softmax, dropout, @v."""

    def __init__(self, h: int, a: int, p: float, s: int):
        super().__init__()
        self.a = a
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)
        self.register_buffer("causal", torch.tril(torch.ones(s, s)).view(1, 1, s, s).bool())

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, s, self.a, h // self.a).transpose(1, 2)
        k = k.view(b, s, self.a, h // self.a).transpose(1, 2)
        v = v.view(b, s, self.a, h // self.a).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.a))
        att = att.masked_fill(~self.causal, float("-inf"))  # sequence length == buffer size
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, h)
        return self.resid_drop(self.proj(y))


class GPTLayer(nn.Module):
    def __init__(self, h: int = H, a: int = A, p: float = 0.1, s: int = S):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(h), Attention(h, a, p, s), nn.LayerNorm(h)
        self.fc1, self.act, self.fc2 = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class LlamaLayer(nn.Module):
    """RMSNorm, GQA through fused causal attention, SwiGLU MLP."""

    def __init__(self, h: int = H, a: int = A, kv: int = 2, f: int = 160):
        super().__init__()
        self.a, self.kv, self.d = a, kv, h // a
        self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.q, self.o = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, kv * self.d, bias=False)
        self.v = nn.Linear(h, kv * self.d, bias=False)
        self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        hn = self.n1(x)
        q = self.q(hn).view(b, s, self.a, self.d).transpose(1, 2)
        k = self.k(hn).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v(hn).view(b, s, self.kv, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, s, h))
        hn = self.n2(x)
        return x + self.down(F.silu(self.gate(hn)) * self.up(hn))


# ---------------------------------------------------------------- matmul family


class Matmuls(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 24)
        self.w = nn.Parameter(torch.empty(8, 24))
        self.bias = nn.Parameter(torch.empty(24))

    def forward(self, x, y, z):  # x: (5, 8), y: (3, 5, 8), z: (3, 8, 6)
        return (self.lin(x), F.linear(x, self.w.t()), x @ self.w, torch.mm(x, self.w),
                torch.addmm(self.bias, x, self.w), torch.bmm(y, z), y.matmul(z),
                torch.einsum("bmk,bkn->bmn", y, z))


def test_matmul_family_is_2mnk_forward_and_4mnk_backward():
    gm = fake_trace(on_meta(Matmuls), meta(5, 8), meta(3, 5, 8), meta(3, 8, 6))
    cs = costs(gm)
    flat = 2 * 5 * 24 * 8
    batched = 2 * 3 * 5 * 6 * 8
    expected = {"lin": flat, "linear": flat, "matmul": flat, "mm": flat, "addmm": flat,
                "bmm": batched, "matmul_1": batched, "einsum": batched}
    for name, flops in expected.items():
        c = cs[name]
        assert c.op_class == "matmul", name
        assert (c.fwd_flops, c.bwd_flops, c.matmul_flops) == (flops, 2 * flops, flops), name


def test_linear_saves_its_input_and_counts_weight_bytes():
    gm = fake_trace(nn.Sequential(on_meta(nn.Linear, 8, 24)), meta(5, 8))
    c = costs(gm)["_0"]
    assert c.saved == (("input_1", 5 * 8 * 2.0),)
    assert c.fwd_bytes == 2 * (5 * 8 + 8 * 24 + 24 + 5 * 24)  # x, W, b, out in bf16
    assert c.bwd_bytes == 2 * c.fwd_bytes


def test_matmul_with_a_constant_keeps_only_what_the_grad_needs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.empty(8, 8))

        def forward(self, x, y):
            return x @ self.table, x @ y

    cs = costs(fake_trace(on_meta(M), meta(4, 8), meta(8, 8)))
    assert cs["matmul"].saved == ()  # the buffer needs no grad, so x is not kept
    assert dict(cs["matmul_1"].saved) == {"x": 64.0, "y": 128.0}


# ---------------------------------------------------------------- GPT layer (Korthikanti)


def korthikanti_bytes(s: int, b: int, h: int, a: int) -> float:
    return s * b * h * (34 + 5 * a * s / h)


def test_gpt_layer_saved_bytes_match_korthikanti():
    gm = fake_trace(on_meta(GPTLayer), meta(B, S, H))
    cs = costs(gm)
    assert saved_total(cs) == korthikanti_bytes(S, B, H, A)
    # Dropout masks: 1 byte per element, named after the dropout node.
    assert cs["attn_attn_drop"].saved == (("attn_attn_drop:mask", B * A * S * S),)
    assert saved_node_name("attn_attn_drop:mask") == "attn_attn_drop"


def test_gpt_layer_matmul_flops_match_narayanan():
    cs = costs(fake_trace(on_meta(GPTLayer), meta(B, S, H)))
    assert matmul_total(cs) == 24 * B * S * H**2 + 4 * B * S**2 * H
    assert sum(c.bwd_flops for c in cs.values() if c.op_class == "matmul") == 2 * matmul_total(cs)


def test_gpt_layer_without_dropout_dedups_through_the_identity():
    """No masks, and ``att @ v`` keeps the softmax output itself: 32sbh + 2as^2b."""
    cs = costs(fake_trace(on_meta(GPTLayer, p=0.0), meta(B, S, H)))
    assert saved_total(cs) == S * B * H * 32 + 2 * A * S * S * B
    assert cs["attn_attn_drop"] == OpCost("view", 0, 0, 0, 0, ())


def test_eval_mode_dropout_is_free():
    model = on_meta(GPTLayer).eval()
    cs = costs(fake_trace(model, meta(B, S, H)))
    assert cs["drop"].fwd_bytes == 0 and cs["drop"].saved == ()


def test_norms_memory_bound_and_save_input():
    cs = costs(fake_trace(on_meta(GPTLayer), meta(B, S, H)))
    ln = cs["ln1"]
    assert ln.op_class == "norm" and ln.saved == (("x", S * B * H * 2.0),)
    assert ln.fwd_flops == 7 * S * B * H
    assert ln.fwd_bytes == 2 * (2 * S * B * H + 2 * H)  # read x, write y, weight + bias


def test_non_contiguous_copy_counts_bytes_views_do_not():
    cs = costs(fake_trace(on_meta(GPTLayer), meta(B, S, H)))
    for name in ("view", "transpose", "transpose_3", "chunk", "getitem_3"):
        assert cs[name] == OpCost("view", 0, 0, 0, 0, ()), name
    # a copy is a kernel: priced by its bytes, and per element as a strided op reading a
    # transposed tensor
    assert cs["contiguous"].op_class == "elementwise"
    assert cs["contiguous"].fwd_bytes == 2 * B * S * H * 2  # read + write a transposed tensor
    assert (cs["contiguous"].per_element, cs["contiguous"].elements) == ("strided", B * S * H)


class _Rotate(nn.Module):
    def forward(self, x, table):
        heads = x.transpose(1, 2)  # [b, h, s, d] of a [b, s, h, d] tensor
        return heads * table, x * table.unsqueeze(1), heads.contiguous() + 1.0


def test_only_a_non_contiguous_operand_read_in_full_is_strided():
    """Ops over a transposed operand run element by element (priced per element when measured,
    cost_model.hardware.cluster); a broadcast operand or contiguous data does not make an op strided."""
    x = meta(2, 8, 4, 16).requires_grad_()
    cs = costs(fake_trace(_Rotate(), x, meta(8, 16)))
    assert (cs["mul"].per_element, cs["mul"].elements) == ("strided", 2 * 8 * 4 * 16)
    assert cs["mul_1"].per_element == ""        # contiguous, the table broadcast
    assert cs["contiguous"].per_element == "strided"
    assert cs["add"].per_element == ""          # after the copy, contiguous


# ---------------------------------------------------------------- export (aten graphs)


def exported_gpt() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    model = GPTLayer().to(BF16)  # tiny real CPU weights: export needs none on meta
    return torch.export.export(model, (torch.randn(B, S, H, dtype=BF16),))


@pytest.fixture(scope="module")
def gpt_export():
    return exported_gpt()


def test_export_graph_matches_symbolic_trace(gpt_export):
    traced = costs(fake_trace(on_meta(GPTLayer), meta(B, S, H)))
    for gm in (gpt_export.graph_module, gpt_export.module()):
        cs = costs(gm)
        assert matmul_total(cs) == matmul_total(traced)
        assert saved_total(cs) == korthikanti_bytes(S, B, H, A)


def test_decomposed_export_matches_too(gpt_export):
    """Core aten: linear -> permute + addmm, matmul -> expand/clone/bmm, native_dropout."""
    gm = gpt_export.run_decompositions().graph_module
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.addmm.default", "aten.bmm.default", "aten.native_dropout.default"} <= targets
    cs = costs(gm)
    assert matmul_total(cs) == 24 * B * S * H**2 + 4 * B * S**2 * H
    assert saved_total(cs) == korthikanti_bytes(S, B, H, A)


# ---------------------------------------------------------------- Llama: RMSNorm, GQA, SwiGLU


def llama_matmul_flops(b=B, s=S, h=H, a=A, kv=2, f=160):
    t, d = b * s, h // a
    linears = 2 * t * h * (h + 2 * kv * d + h) + 2 * t * 3 * h * f  # q k v o, gate up down
    attention = 4 * b * a * s * s * d / 2  # causal
    return linears, attention


def test_llama_layer_flops_by_hand():
    cs = costs(fake_trace(on_meta(LlamaLayer), meta(B, S, H)))
    linears, attention = llama_matmul_flops()
    sdpa = cs["scaled_dot_product_attention"]
    assert sdpa.op_class == "attention"
    assert (sdpa.fwd_flops, sdpa.matmul_flops) == (attention, attention)
    assert sdpa.bwd_flops == 2.5 * attention
    assert matmul_total(cs) == linears + attention
    bwd = sum(c.bwd_flops for c in cs.values() if c.op_class in ("matmul", "attention"))
    assert bwd == 2 * linears + 2.5 * attention
    assert cs["n1"].op_class == "norm" and cs["n1"].fwd_flops == 4 * B * S * H


def test_llama_layer_saved_bytes_by_hand():
    cs = costs(fake_trace(on_meta(LlamaLayer), meta(B, S, H)))
    t, kv_width, f = B * S, 2 * (H // A), 160
    act = 2 * t * H  # one bf16 (tokens, hidden) tensor
    assert dict(cs["scaled_dot_product_attention"].saved) == {
        "q": act, "k": 2 * t * kv_width, "v": 2 * t * kv_width,
        "scaled_dot_product_attention": act,
        "scaled_dot_product_attention:logsumexp": 4 * B * A * S}
    assert dict(cs["mul"].saved) == {"silu": 2 * t * f, "up": 2 * t * f}  # SwiGLU keeps both
    assert cs["silu"].saved == (("gate", 2 * t * f),)
    # The o-proj input is a copy unless the attention kernel already wrote the
    # output in (b, s, heads, d) order; the fake kernel's strides decide.
    (o_input, _), = cs["o"].saved
    o_copy = act if o_input != "scaled_dot_product_attention" else 0
    expected = (6 * act  # x, n1 out, q, attention out, residual sum, n2 out
                + o_copy + 2 * 2 * t * kv_width + 4 * B * A * S + 4 * 2 * t * f)
    assert saved_total(cs) == expected


def test_llama_export_matches_trace():
    torch.manual_seed(0)
    ep = torch.export.export(LlamaLayer().to(BF16), (torch.randn(B, S, H, dtype=BF16),))
    targets = {str(n.target) for n in ep.graph.nodes}
    assert "aten.scaled_dot_product_attention.default" in targets
    assert matmul_total(costs(ep.graph_module)) == sum(llama_matmul_flops())


def test_explicit_gqa_counts_matmuls_by_operand_shapes():
    class ExplicitGQA(nn.Module):
        def forward(self, q, k, v):  # q: (b, 4, s, d); k, v: (b, 2, s, d)
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v

    b, s, d = 2, 8, 16
    gm = fake_trace(ExplicitGQA(), meta(b, 4, s, d), meta(b, 2, s, d), meta(b, 2, s, d))
    cs = costs(gm)
    assert matmul_total(cs) == 2 * (2 * b * 4 * s * s * d)
    assert cs["repeat_interleave"].op_class == "elementwise"
    assert cs["repeat_interleave"].fwd_flops == 0
    assert cs["repeat_interleave"].fwd_bytes == 2 * (b * 2 * s * d + b * 4 * s * d)


# ---------------------------------------------------------------- embedding and loss


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, h: int = 32):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, h), nn.Linear(h, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def test_embedding_and_cross_entropy():
    b, s, vocab, h = 2, 8, 50, 32
    ids = meta(b, s, dtype=torch.long)
    cs = costs(fake_trace(on_meta(TinyLM), ids, ids))
    emb, loss = cs["emb"], cs["cross_entropy"]
    assert emb.op_class == "embedding" and emb.fwd_flops == 0
    assert emb.saved == (("ids", b * s * 8.0),)
    assert emb.fwd_bytes == 2 * (b * s * h * 2) + b * s * 8
    assert loss.op_class == "loss" and loss.fwd_flops > 0
    assert dict(loss.saved) == {"cross_entropy:log_softmax": b * s * vocab * 2, "labels": b * s * 8}


def test_a_vocabulary_parallel_loss_keeps_fp32_probabilities():
    """The runtime's vocabulary-parallel loss (passes.rewrite.vocab_parallel) keeps its
    probabilities in fp32 whatever the logits' dtype: twice a bf16 log-softmax."""
    from passes.rewrite.vocab_parallel import vocab_parallel_cross_entropy
    b, s, vocab = 2, 8, 50
    ids = meta(b, s, dtype=torch.long)
    gm = fake_trace(on_meta(TinyLM), ids, ids)
    (loss,) = [n for n in gm.graph.nodes if n.name == "cross_entropy"]
    loss.target, loss.args, loss.kwargs = vocab_parallel_cross_entropy, (*loss.args[:2], 0,
                                                                         vocab), {}
    saved = dict(costs(gm)["cross_entropy"].saved)
    assert saved == {"cross_entropy:log_softmax": b * s * vocab * 4, "labels": b * s * 8}


def test_embedding_and_cross_entropy_in_aten_graphs():
    """Training IR keeps aten.cross_entropy_loss; core aten lowers it to
    _log_softmax + gather, priced as an elementwise softmax that keeps its output."""
    torch.manual_seed(0)
    b, s, vocab = 2, 8, 50
    ids = torch.randint(0, vocab, (b, s))
    ep = torch.export.export(TinyLM().to(BF16), (ids, ids.clone()))
    training_ir = costs(ep.graph_module)
    assert dict(training_ir["cross_entropy_loss"].saved)["cross_entropy_loss:log_softmax"] == (
        b * s * vocab * 2)
    assert training_ir["embedding"].op_class == "embedding"
    core = costs(ep.run_decompositions().graph_module)
    assert core["_log_softmax"].saved == (("_log_softmax", b * s * vocab * 2.0),)
    assert core["embedding"].saved == training_ir["embedding"].saved


# ---------------------------------------------------------------- errors, collectives, leaves


def test_unknown_op_is_priced_memory_bound_with_one_warning_naming_it(monkeypatch):
    """cumprod has no rule: it reads x and writes y (bytes), one FLOP per element, backward
    twice that, and keeps x; the warning names node, op and module, once per op."""
    monkeypatch.setattr(op_fallback, "_WARNED", set())
    class Block(nn.Module):
        def forward(self, x):
            return torch.cumprod(x, dim=1)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    x = meta(4, 8).requires_grad_()
    gm = fake_trace(Outer(), x)
    with pytest.warns(UnpricedOpWarning, match=r"'cumprod'.*cumprod.*'block'.*memory-bound"):
        priced = costs(gm)
    (cost,) = [c for name, c in priced.items() if "cumprod" in name]
    assert (cost.fwd_flops, cost.bwd_flops) == (32.0, 64.0)
    assert cost.fwd_bytes == 2 * 32 * 2
    assert cost.saved == (("x", 64.0),)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second pricing of the same op does not warn again
        costs(fake_trace(Outer(), x))


def user_scale(x):
    return x * 2


torch.fx.wrap("user_scale")


def test_user_functions_are_not_priced_by_name(monkeypatch):
    monkeypatch.setattr(op_fallback, "_WARNED", set())

    class M(nn.Module):
        def forward(self, x):
            return user_scale(x)

    with pytest.warns(UnpricedOpWarning, match="user_scale"):
        costs(fake_trace(M(), meta(4, 8)))


def test_missing_fake_values_are_an_error():
    gm = torch.fx.symbolic_trace(on_meta(GPTLayer))
    with pytest.raises(ValueError, match="FakeTensorProp"):
        costs(gm)


def fake_all_gather(x):
    return torch.cat([x, x])


fake_all_gather._fxpar_collective = "all_gather"


def test_collectives_are_comm_with_zero_flops():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(fake_all_gather, (x,)))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(meta(4, 8)))
    c = costs(gm)["fake_all_gather"]
    assert c.op_class == "comm" and c.fwd_flops == c.bwd_flops == 0
    assert c.fwd_bytes == c.bwd_bytes == 2 * 4 * 8 * 2  # the gathered (output) buffer
    assert c.saved == ()


def test_graph_plumbing_is_free():
    """Placeholders, constants, the output and shape arithmetic (x.shape, h // a)."""
    gm = fake_trace(on_meta(GPTLayer), meta(B, S, H))
    cs = costs(gm)
    plumbing = [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr", "output")
                or not isinstance(n.meta.get("val"), (torch.Tensor, tuple))]
    assert {n.op for n in plumbing} == {"placeholder", "get_attr", "output", "call_function"}
    for node in plumbing:
        assert cs[node.name] == OpCost("view", 0, 0, 0, 0, ()), node.name


def test_residual_add_and_scalar_mul_keep_nothing():
    cs = costs(fake_trace(on_meta(GPTLayer), meta(B, S, H)))
    assert cs["add"].saved == () and cs["mul"].saved == () and cs["masked_fill"].saved == ()
    assert cs["softmax"].saved == (("softmax", B * A * S * S * 2.0),)
    assert cs["add"].fwd_bytes == 3 * B * S * H * 2  # memory-bound: two reads, one write
