"""Recomputation as the frameworks state it: per-block recompute modes of a pattern (uniform,
Megatron's --recompute-method block, torchtitan's one layer in n), and block strategies with
given tensor and sequence parallelism (planner.interop.emit writes them, from_megatron and
from_torchtitan read them)."""
from __future__ import annotations

from cost_model.layers.strategy import Strategy


def recompute_of(stages) -> list[list[str]]:
    return [[Strategy.parse(s).recompute for s in stage] for stage in stages]


def pattern_recompute(lengths: list[int], pattern: tuple, ranks: int) -> list[list[str]]:
    """Per-block recomputation of a pattern: ("uniform", r) every block r; ("block", k) the first
    k blocks of every stage full (Megatron's --recompute-method block); ("every", n) every n-th
    block a rank holds full, counted across its stages in order (torchtitan's selective
    activation checkpointing with an integer option)."""
    kind, value = pattern
    if kind == "uniform":
        return [[value] * n for n in lengths]
    if kind == "block":
        return [["full"] * min(value, n) + ["none"] * max(n - value, 0) for n in lengths]
    out = [[] for _ in lengths]
    for rank in range(ranks):
        count = 0
        for s in range(rank, len(lengths), ranks):
            for _ in range(lengths[s]):
                count += 1
                out[s].append("full" if count % value == 0 else "none")
    return out


def with_flags(stages, tp: bool, sp, recompute: list[list[str]]):
    """Block strategies with tensor parallelism `tp`, sequence parallelism `sp` (True, False or
    None: each block keeps its own) and the given recomputation."""
    out = []
    for stage, rec in zip(stages, recompute):
        row = []
        for s, r in zip(stage, rec):
            own = Strategy.parse(s)
            keep_sp = own.sp if sp is None else sp
            row.append(str(Strategy(tp, keep_sp and tp, r)))
        out.append(tuple(row))
    return tuple(out)
