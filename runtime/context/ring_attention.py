"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Each rank holds the queries, keys and values of its own tokens, in a `runtime.programs.token_split` layout,
as [batch, heads, local tokens, head_dim]. The K/V blocks go once around the ring: at each of cp
steps a rank attends its queries to the block it holds while the next block is already in flight
(isend and irecv are posted before the compute), and merges the partial result by log-sum-exp.
No rank holds more than two K/V blocks, and no score block is larger than (s/cp)².

Backward is exact the flash-attention way: per block, the probabilities are recomputed from the
saved q, k, v, output and log-sum-exp. The K/V blocks go round a second time; behind each travels
the accumulator of its dK/dV, which every rank adds to and passes on, so that after cp steps it
arrives complete at the block's owner.

Causal masks are decided per pair of chunks from their global chunk indices: a key chunk before the
query chunk is fully visible, one after it is skipped, the same chunk gets the triangular mask. With
the zig-zag layout every rank then does the same work at every step.

An explicit mask (padding, sliding windows, packed sequences) comes as this rank's query rows of the
whole mask, [..., local tokens, seq] with the keys in global order (passes.rewrite.cp_masks builds it); each
block takes its columns, and a boolean block that masks everything is skipped. A query row that
sees no key at all gets 0, as F.scaled_dot_product_attention gives it.

K/V may have fewer (grouped) heads than q; they travel unexpanded and are repeated per block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.comm import collectives
from runtime.programs.token_split import chunk_ids, num_chunks

# K/V blocks and dK/dV accumulators both flow to the next rank, concurrently in backward: distinct
# message tags keep the two streams apart.
_KV_TAG, _GRAD_TAG = 7001, 7002


@dataclass(frozen=True)
class Transfer:
    """One shift in flight; `wait` returns the tensor received from the previous rank."""

    works: tuple
    received: torch.Tensor

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


@dataclass(frozen=True)
class Ring:
    """The ranks of one group in a ring; `tag` names the layer in the traffic counter."""

    group: dist.ProcessGroup
    rank: int      # index within the group
    size: int
    tag: str = ""

    @classmethod
    def of(cls, group: dist.ProcessGroup, tag: str = "") -> "Ring":
        return cls(group, dist.get_rank(group), dist.get_world_size(group), tag)

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def shift(self, tensor: torch.Tensor, message_tag: int) -> Transfer:
        """Send `tensor` to the next rank; receive the previous rank's tensor of the same shape."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self._peer(1), self.group, message_tag),
            dist.P2POp(dist.irecv, received, self._peer(-1), self.group, message_tag)])
        collectives.count_traffic("p2p", self.tag, tensor.numel() * tensor.element_size(), 2)
        return Transfer(tuple(works), received)

    def blocks(self, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(source rank, its stacked K/V) for every rank, own first; the next block is in flight
        while the caller computes on the current one."""
        for step in range(self.size):
            pending = self.shift(kv, _KV_TAG) if step < self.size - 1 else None
            yield (self.rank - step) % self.size, kv
            if pending is not None:
                kv = pending.wait()


class GradientRing:
    """Carries each block's dK/dV accumulator on to the next rank behind its K/V block."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.inflight: Transfer | None = None

    def settle(self, source: int, grad: torch.Tensor) -> None:
        # What arrives now was sent by the previous rank one step ago: the accumulator of the very
        # block (source) this rank just worked on.
        if self.inflight is not None:
            grad = grad + self.inflight.wait()
        self.inflight = self.ring.shift(grad, _GRAD_TAG)

    def finish(self) -> torch.Tensor:
        """After the last step the accumulator arriving is this rank's own block, complete."""
        return self.inflight.wait()


@dataclass(frozen=True)
class Spec:
    """What decides the masks and scaling of every block pair."""

    cp: int
    layout: str
    causal: bool
    scale: float
    seq: int = 0      # the whole sequence, with an explicit mask (its columns); else 0

    def pairs(self, q_rank: int, k_rank: int) -> list[tuple[int, int, bool]]:
        """(local query chunk, local key chunk, diagonal mask) for each pair that attends."""
        found = []
        for i, a in enumerate(chunk_ids(self.cp, q_rank, self.layout)):
            for j, b in enumerate(chunk_ids(self.cp, k_rank, self.layout)):
                if not self.causal or b < a:
                    found.append((i, j, False))
                elif b == a:
                    found.append((i, j, True))
        return found

    @property
    def parts(self) -> int:
        return num_chunks(self.cp, self.layout) // self.cp

    def block_mask(self, rows: torch.Tensor | None, k_rank: int, j: int) -> torch.Tensor | None:
        """The columns of key chunk j of rank k_rank in one query chunk's rows of the mask."""
        if rows is None:
            return None
        width = self.seq // num_chunks(self.cp, self.layout)
        start = chunk_ids(self.cp, k_rank, self.layout)[j] * width
        return rows[..., start:start + width]


def _rows(mask: torch.Tensor | None, spec: Spec) -> list:
    """The mask's rows of each local query chunk ([None, ...] without a mask)."""
    return mask.chunk(spec.parts, dim=-2) if mask is not None else [None] * spec.parts


def _visible(rows: list, spec: Spec) -> list[list[bool]] | None:
    """For each local query chunk, which global key chunks its boolean mask lets it see at all
    (a block that sees nothing does no work); read once per call, one host sync, not per block.
    None without a boolean mask: every block is computed."""
    if rows[0] is None or rows[0].dtype != torch.bool:
        return None
    chunks = num_chunks(spec.cp, spec.layout)
    return [r.unflatten(-1, (chunks, -1)).transpose(-2, -1).flatten(0, -2).any(0).tolist()
            for r in rows]


def _skipped(visible: list[list[bool]] | None, spec: Spec, i: int, k_rank: int, j: int) -> bool:
    return visible is not None and not visible[i][chunk_ids(spec.cp, k_rank, spec.layout)[j]]


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp with rows that see no key (-inf) at 0, so that their weights are 0, not
    nan."""
    return torch.where(torch.isneginf(lse), 0.0, lse)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Blocks are computed and merged in at least fp32 (bf16 inputs would lose the merge)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped K/V heads repeated to the query heads (query head h uses K/V head h // rep)."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradient of `_expand`: sum over the query heads sharing one K/V head."""
    return grad if grad.size(1) == kv_heads else grad.unflatten(1, (kv_heads, -1)).sum(2)


def _scores(q, k, scale: float, diagonal: bool, mask: torch.Tensor | None = None) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        above = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if mask is not None:  # as F.scaled_dot_product_attention reads attn_mask
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else \
            scores + mask
    return scores


def block_forward(q, k, v, scale: float, diagonal: bool,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to one K/V block: (output, log-sum-exp of each query row's scores)."""
    scores = _scores(q, _expand(k, q.size(1)), scale, diagonal, mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - _safe(lse)) @ _expand(v, q.size(1)), lse


def merge(acc, block):
    """Combine two partial attentions over disjoint key sets, weighted by their softmax mass."""
    if acc is None:
        return block
    (out, lse), (block_out, block_lse) = acc, block
    total = torch.logaddexp(lse, block_lse)
    base = _safe(total)
    return out * torch.exp(lse - base) + block_out * torch.exp(block_lse - base), total


def block_backward(q, k, v, dout, lse, delta, scale: float, diagonal: bool,
                   mask: torch.Tensor | None = None):
    """(dq, dk, dv) of one block pair, from the final log-sum-exp and delta = rowsum(dout·out)."""
    heads = q.size(1)
    k_full, v_full = _expand(k, heads), _expand(v, heads)
    probs = torch.exp(_scores(q, k_full, scale, diagonal, mask) - _safe(lse))
    dv = probs.transpose(-2, -1) @ dout
    dscores = probs * (dout @ v_full.transpose(-2, -1) - delta)
    dq = (dscores @ k_full) * scale
    dk = (dscores.transpose(-2, -1) @ q) * scale
    return dq, _fold(dk, k.size(1)), _fold(dv, v.size(1))


def forward_blocks(q: torch.Tensor, blocks: Iterable[tuple[int, torch.Tensor]], spec: Spec,
                   rank: int, mask: torch.Tensor | None = None, visible=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output (≥ fp32) and log-sum-exp over every (source, stacked K/V)
    block; `mask`: this rank's rows of the whole mask (see the module docstring), `visible`:
    its blocks that do work, when already read (_visible)."""
    queries = _wide(q).chunk(spec.parts, dim=2)
    rows = _rows(mask, spec)
    visible = visible if visible is not None else _visible(rows, spec)
    acc = [None] * spec.parts
    for source, kv in blocks:
        keys, values = _wide(kv[0]).chunk(spec.parts, dim=2), _wide(kv[1]).chunk(spec.parts, dim=2)
        for i, j, diagonal in spec.pairs(rank, source):
            block_mask = spec.block_mask(rows[i], source, j)
            if not _skipped(visible, spec, i, source, j):
                acc[i] = merge(acc[i], block_forward(queries[i], keys[j], values[j], spec.scale,
                                                     diagonal, block_mask))
    nothing = [(torch.zeros_like(x), torch.full_like(x[..., :1], float("-inf"))) for x in queries]
    acc = [a if a is not None else none for a, none in zip(acc, nothing)]
    return torch.cat([a[0] for a in acc], dim=2), torch.cat([a[1] for a in acc], dim=2)


def backward_blocks(dout, q, out, lse, blocks: Iterable[tuple[int, torch.Tensor]], spec: Spec,
                    rank: int, settle: Callable[[int, torch.Tensor], None],
                    mask: torch.Tensor | None = None, visible=None) -> torch.Tensor:
    """dq (≥ fp32) of this rank; each block's stacked dK/dV contribution is handed to `settle`."""
    dout, out = _wide(dout), _wide(out)
    delta = (dout * out).sum(-1, keepdim=True)
    split = lambda x: x.chunk(spec.parts, dim=2)  # noqa: E731 - one query chunk per local part
    queries, douts, lses, deltas = split(_wide(q)), split(dout), split(lse), split(delta)
    dq = torch.zeros(q.shape, dtype=queries[0].dtype, device=q.device)
    dqs = split(dq)
    rows = _rows(mask, spec)
    visible = visible if visible is not None else _visible(rows, spec)
    for source, kv in blocks:
        kv = _wide(kv)
        grad = torch.zeros_like(kv)
        keys, values = split(kv[0]), split(kv[1])
        dks, dvs = split(grad[0]), split(grad[1])
        for i, j, diagonal in spec.pairs(rank, source):
            block_mask = spec.block_mask(rows[i], source, j)
            if _skipped(visible, spec, i, source, j):
                continue
            dq_i, dk_j, dv_j = block_backward(queries[i], keys[j], values[j], douts[i], lses[i],
                                              deltas[i], spec.scale, diagonal, block_mask)
            dqs[i].add_(dq_i)
            dks[j].add_(dk_j)
            dvs[j].add_(dv_j)
        settle(source, grad)
    return dq


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, spec: Spec, mask: torch.Tensor | None):
        visible = _visible(_rows(mask, spec), spec)  # read once, for forward and backward
        out, lse = forward_blocks(q, ring.blocks(torch.stack([k, v])), spec, ring.rank, mask,
                                  visible)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.ring, ctx.spec, ctx.visible = ring, spec, visible
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        ring = ctx.ring
        grads = GradientRing(ring)
        dq = backward_blocks(dout, q, out, lse, ring.blocks(torch.stack([k, v])), ctx.spec,
                             ring.rank, grads.settle, mask, ctx.visible)
        dkv = grads.finish()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _is_real(x: torch.Tensor) -> bool:
    return not (x.is_meta or type(x).__name__ == "FakeTensor")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str = "cp",
                   causal: bool = False, layout: str = "zigzag", scale: float | None = None,
                   tag: str = "", mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale [+ mask]) v over the whole sequence, each rank of the group named
    `group` holding its own tokens ([batch, heads, local tokens, head_dim]) in `layout`; returns
    this rank's rows. `mask` (not with causal): this rank's query rows of the whole sequence's
    mask, [..., local tokens, seq], boolean (True: attend) or added to the scores.

    Outside a process group, and on fake or meta tensors (shape propagation, pricing), it is plain
    scaled-dot-product attention of the local tokens, which is exact for a group of one.
    """
    if q.size(1) % k.size(1) or k.shape != v.shape:
        raise ValueError(f"ring attention needs k and v of one shape with heads dividing the "
                         f"query heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if mask is not None and (causal or mask.requires_grad or mask.size(-2) != q.size(-2)):
        raise ValueError(f"ring attention's mask must be a constant of this rank's "
                         f"{q.size(-2)} query rows, not with causal=True; got "
                         f"{tuple(mask.shape)}, causal={causal}")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    process_group = collectives._GROUPS.get(group)
    if process_group is None and _is_real(q) and dist.is_initialized():
        raise RuntimeError(f"ring attention over group {group!r}, but no process group is bound "
                           f"to that name (runtime.comm.collectives.bind_groups({group}=...))")
    if process_group is None or not _is_real(q) or dist.get_world_size(process_group) == 1:
        local = mask if mask is None or mask.size(-1) == k.size(-2) else None  # shapes only
        return F.scaled_dot_product_attention(q, k, v, attn_mask=local, is_causal=causal,
                                              scale=scale, enable_gqa=k.size(1) != q.size(1))
    ring = Ring.of(process_group, tag)
    seq = mask.size(-1) if mask is not None else 0
    return _RingAttention.apply(q, k, v, ring, Spec(ring.size, layout, causal, scale, seq), mask)


ring_attention._fxpar_collective = "ring_p2p"
