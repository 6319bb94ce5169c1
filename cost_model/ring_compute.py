"""The compute of ring attention, op by op, as runtime.ring_attention runs it.

Under context parallelism an attention is not one fused kernel: every block pair writes its scores
out ([queries, keys] per head), masks them, takes their log-sum-exp, and merges the partial outputs;
backward recomputes the probabilities of every pair the flash-attention way and adds each block's
dK/dV into an accumulator. On a CPU those elementwise passes over score blocks, not the matmuls,
are most of the time, so pricing the ring as the fused kernel it replaces was far too cheap.

`ring_ops` traces the runtime's own block loops (`forward_blocks`, `backward_blocks`, with the
K/V stacking of the autograd function and the accumulators' sums) with make_fx on fake tensors,
and returns every op's OpCost, so the price follows the code it describes. Every op works on each
(sample, K/V head) group apart, so one trace of TRACED_GROUPS groups per sequence and cp prices
any micro-batch and any tensor-parallel share of the heads: flops, bytes and elements scale by
samples × K/V heads / TRACED_GROUPS, the per-op floors and overheads do not. Two groups, not one,
so that the chunks of the sequence are strided views as in any real batch (a CPU runs strided
elementwise ops at its own, slower rate: OpCost.per_element).
The rank traced is the last one: with the zig-zag layout every rank does the same work, with the
contiguous layout under a causal mask the last rank does the most.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from cost_model.op_graph import OpCost
from cost_model.ops import node_cost

TRACED_GROUPS = 2  # samples traced, each with one K/V head and the query heads that share it


@dataclass(frozen=True)
class RingShape:
    """One attention of a layer, as ring attention would take it on one rank (heads tp-local)."""

    heads: int         # query heads
    kv_heads: int      # K/V heads (fewer under grouped-query attention)
    seq: int           # the whole sequence
    head_dim: int
    causal: bool
    mask: str          # "" without an explicit mask, else its dtype ("torch.bool", ...)
    dtype: str         # of q, k and v

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool,
           mask: torch.Tensor | None) -> "RingShape":
        return cls(q.size(1), k.size(1), q.size(2), q.size(3), causal,
                   str(mask.dtype) if mask is not None else "", str(q.dtype))


def ring_ops(shape: RingShape, cp: int, layout: str = "zigzag"
             ) -> tuple[tuple[OpCost, ...], tuple[OpCost, ...]]:
    """(forward ops, backward ops) of one rank's ring attention over `cp` ranks, for
    TRACED_GROUPS (sample, K/V head) groups (see the module docstring). Each pass runs its own
    code and nothing in it is differentiated: price every op as a forward kernel."""
    # the trace depends on the heads only through their grouping: one per tensor-parallel size
    # would be the same graph
    return _traced(dataclasses.replace(shape, heads=shape.heads // shape.kv_heads, kv_heads=1),
                   cp, layout)


def calls(ops: tuple[OpCost, ...]) -> int:
    """Ops the ring calls from Python (views and make_fx's decomposition of a matmul into views
    around one bmm are not calls of their own)."""
    return sum(1 for op in ops if op.op_class != "view")


@functools.lru_cache(maxsize=256)
def _traced(shape: RingShape, cp: int, layout: str):
    from torch.fx.experimental.proxy_tensor import make_fx

    from runtime.cp_data import num_chunks
    from runtime.ring_attention import Spec, backward_blocks, forward_blocks

    dtype = getattr(torch, shape.dtype.removeprefix("torch."))
    local = shape.seq // cp
    group = shape.heads // shape.kv_heads
    spec = Spec(cp, layout, shape.causal, shape.head_dim ** -0.5,
                shape.seq if shape.mask else 0)
    rank = cp - 1
    sources = [(rank - step) % cp for step in range(cp)]
    mask = None
    if shape.mask:
        mask = torch.empty(1, 1, local, shape.seq,
                           dtype=getattr(torch, shape.mask.removeprefix("torch.")))
    # a boolean mask's blocks that see nothing are skipped at run time; priced as all computed
    visible = [[True] * num_chunks(cp, layout)] * spec.parts if shape.mask == "torch.bool" \
        else None

    def forward(q, k, v, *masks):
        kv = torch.stack([k, v])
        out, lse = forward_blocks(q, [(s, kv) for s in sources], spec, rank,
                                  masks[0] if masks else None, visible)
        return out.to(q.dtype), lse

    def backward(dout, q, k, v, out, lse, *masks):
        kv = torch.stack([k, v])
        held = []

        def settle(_source, grad):  # the accumulator arriving is added before it moves on
            held.append(grad if not held else grad + held[-1])
        dq = backward_blocks(dout, q, out, lse, [(s, kv) for s in sources], spec, rank, settle,
                             masks[0] if masks else None, visible)
        return dq.to(q.dtype), held[-1][0].to(k.dtype), held[-1][1].to(v.dtype)

    q = torch.empty(TRACED_GROUPS, group, local, shape.head_dim, dtype=dtype)
    k = torch.empty(TRACED_GROUPS, 1, local, shape.head_dim, dtype=dtype)
    lse = torch.empty(TRACED_GROUPS, group, local, 1,
                      dtype=torch.promote_types(dtype, torch.float32))
    extra = (mask,) if mask is not None else ()
    fwd = make_fx(forward, tracing_mode="fake")(q, k, k.clone(), *extra)
    bwd = make_fx(backward, tracing_mode="fake")(q, q.clone(), k, k.clone(), q.clone(), lse,
                                                 *extra)
    return _costs(fwd), _costs(bwd)


def _costs(gm: fx.GraphModule) -> tuple[OpCost, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a rule here is a gap to fill, not guess
        return tuple(node_cost(node, {}) for node in gm.graph.nodes
                     if node.op == "call_function")
