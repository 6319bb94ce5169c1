"""The compute of ring attention, op by op, as runtime.context.ring_attention runs it.

Under context parallelism an attention is not one fused kernel: every block pair writes its scores
out ([queries, keys] per head), masks them, takes their log-sum-exp, and merges the partial outputs;
backward recomputes the probabilities of every pair the flash-attention way and adds each block's
dK/dV into an accumulator. On a CPU those elementwise passes over score blocks, not the matmuls,
are most of the time, so pricing the ring as the fused kernel it replaces was far too cheap.

`ring_ops` runs the runtime's own block loops (`forward_blocks`, `backward_blocks`, with the
K/V stacking of the autograd function and the accumulators' sums) on meta tensors, records every
aten op they dispatch as a node of an FX graph, and returns each op's OpCost, so the price
follows the code it describes. Every op works on each (sample, K/V head) group apart, so one
trace of TRACED_GROUPS groups per sequence and cp prices any micro-batch and any tensor-parallel
share of the heads: flops, bytes and elements scale by samples × K/V heads / TRACED_GROUPS, the
per-op floors and overheads do not. Two groups, not one,
so that the chunks of the sequence are strided views as in any real batch (a CPU runs strided
elementwise ops at its own, slower rate: OpCost.per_element).
The rank traced is the last one: with the zig-zag layout every rank does the same work, with the
contiguous layout under a causal mask the last rank does the most.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import warnings
from collections import Counter
from dataclasses import dataclass
from unittest import mock

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from cost_model.ops.graph_facts import OpCost
from cost_model.ops.node_cost import node_cost

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


@functools.lru_cache(maxsize=256)
def ring_op_counts(shape: RingShape, cp: int, layout: str = "zigzag"
                   ) -> tuple[tuple[tuple[OpCost, int], ...], tuple[tuple[OpCost, int], ...]]:
    """`ring_ops` with each distinct op once and how many times it runs: a ring over many
    ranks repeats a few dozen ops thousands of times, and a plan prices it for every micro-batch
    size and strategy."""
    return tuple(tuple(Counter(ops).items()) for ops in ring_ops(shape, cp, layout))


def is_call(op: OpCost) -> bool:
    """Whether the ring calls the op from Python (views and make_fx's decomposition of a matmul
    into views around one bmm are not calls of their own)."""
    return op.op_class != "view"


def calls(ops: tuple[OpCost, ...]) -> int:
    """Ops the ring calls from Python."""
    return sum(1 for op in ops if is_call(op))


@functools.lru_cache(maxsize=256)
def _traced(shape: RingShape, cp: int, layout: str):
    from runtime.programs.token_split import num_chunks
    from runtime.context.ring_attention import Spec, backward_blocks, forward_blocks

    dtype = getattr(torch, shape.dtype.removeprefix("torch."))
    local = shape.seq // cp
    group = shape.heads // shape.kv_heads
    spec = Spec(cp, layout, shape.causal, shape.head_dim ** -0.5,
                shape.seq if shape.mask else 0)
    rank = cp - 1
    sources = [(rank - step) % cp for step in range(cp)]
    mask = None
    if shape.mask:
        mask = _meta(1, 1, local, shape.seq,
                     dtype=getattr(torch, shape.mask.removeprefix("torch.")))
    # a boolean mask's blocks that see nothing are skipped at run time; priced as all computed
    visible = [[True] * num_chunks(cp, layout)] * spec.parts if shape.mask == "torch.bool" \
        else None

    def forward(q, k, v):
        kv = torch.stack([k, v])
        out, lse = forward_blocks(q, [(s, kv) for s in sources], spec, rank, mask, visible)
        return out.to(q.dtype), lse

    def backward(dout, q, k, v, out, lse):
        kv = torch.stack([k, v])
        held = []

        def settle(_source, grad):  # the accumulator arriving is added before it moves on
            held.append(grad if not held else grad + held[-1])
        dq = backward_blocks(dout, q, out, lse, [(s, kv) for s in sources], spec, rank, settle,
                             mask, visible)
        return dq.to(q.dtype), held[-1][0].to(k.dtype), held[-1][1].to(v.dtype)

    q = _meta(TRACED_GROUPS, group, local, shape.head_dim, dtype=dtype)
    k = _meta(TRACED_GROUPS, 1, local, shape.head_dim, dtype=dtype)
    lse = _meta(TRACED_GROUPS, group, local, 1, dtype=torch.promote_types(dtype, torch.float32))
    return (_record(forward, q, k, k.clone()),
            _record(backward, q, q.clone(), k, k.clone(), q.clone(), lse))


def _meta(*size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device="meta")


class _Recorder(TorchDispatchMode):
    """Every aten op run under it, as a node of an FX graph whose values are the ops' meta
    tensors: what node_cost reads, recorded at a fraction of make_fx's cost (the block loops run
    once on meta tensors; no proxies, no fake tensors)."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]):
        super().__init__()
        self.graph = fx.Graph()
        self.nodes: dict[int, fx.Node] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while the graph is built
        self.repeats: list[fx.Node] = []       # nodes of a call repeated (`once`), again
        for i, x in enumerate(inputs):
            self._name(x, self.graph.placeholder(f"input{i}"))

    def _name(self, value, node: fx.Node) -> None:
        node.meta["val"] = value
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.nodes[id(t)] = node
                self.alive.append(t)

    def _node(self, x):
        if isinstance(x, torch.Tensor) and id(x) not in self.nodes:  # a constant made outside
            self._name(x, self.graph.placeholder(f"const{len(self.nodes)}"))
        return self.nodes[id(x)] if isinstance(x, torch.Tensor) else x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        node = self.graph.call_function(func, *pytree.tree_map(self._node, (args, kwargs)))
        self._name(out, node)
        if isinstance(out, (tuple, list)):  # each output as its own getitem, as make_fx has it
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self._name(item, self.graph.call_function(operator.getitem, (node, i)))
        return out


    def once(self, real):
        """`real` recorded on its first call per argument shapes; a later call with the same
        shapes repeats those nodes and returns the first outputs (shapes are all the price
        reads) without running: the block pairs of a large cp cost one recording each kind."""
        seen = {}

        def call(*args):
            key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                        for a in pytree.tree_leaves(args))
            if key in seen:
                out, nodes = seen[key]
                self.repeats += nodes
                return out
            before = len(self.graph.nodes)
            out = real(*args)
            seen[key] = (out, list(self.graph.nodes)[before:])
            return out
        return call


# The ring's functions that run once per block pair: recorded once per kind of pair
_PER_PAIR = ("block_forward", "block_backward", "merge")


def _record(fn, *inputs: torch.Tensor) -> tuple[OpCost, ...]:
    """The OpCost of every op `fn` dispatches on `inputs` (see _Recorder)."""
    from runtime.context import ring_attention
    with _Recorder(inputs) as recorder, contextlib.ExitStack() as patches:
        for name in _PER_PAIR:
            patches.enter_context(mock.patch.object(
                ring_attention, name, recorder.once(getattr(ring_attention, name))))
        fn(*inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an op without a rule here is a gap to fill, not guess
        cost = {node: node_cost(node, {}) for node in recorder.graph.nodes
                if node.op == "call_function"}
    return tuple(cost[node] for node in list(recorder.graph.nodes) + recorder.repeats
                 if node in cost)
