"""The least time the busiest pipeline rank can take when blocks come whole (the stage ILP's
valid inequality ρ ≥ ρ*, planner.search.ilp; the outer search bounds with it too)."""
from __future__ import annotations

import math


def busiest_rank_floor(blocks: int, ranks: int, stages: int, least_block_s: float,
                       embed_s: float, head_s: float, p2p_s: float,
                       stage_s: float = 0.0) -> float:
    """The least ρ at which p ranks can hold all N blocks, on plain numbers (the outer search
    bounds with it before any problem exists): rank r can hold ⌊(ρ − F_r)/t_min⌋ blocks, so

        ρ* = min { ρ ≥ max_r F_r :  Σ_r ⌊(ρ − F_r)/t_min⌋ ≥ N }.

    Every stage crosses a boundary twice but the first and last once, so a rank's fixed time is
    F_r = 2c·v − c·[r = 0] − c·[r = p−1] + E·[r = 0] + H·[r = p−1] + q·v: three kinds of rank (first,
    last, middle), and ρ* is F_r + j·t_min for one of them: the least j that holds them, found
    by searching out from where blocks spread evenly (N·t_min + Σ_r F_r)/p would put it."""
    v = stages // ranks
    def fixed(r: int) -> float:
        first, last = r == 0, r == ranks - 1
        return (2 * p2p_s * v - p2p_s * (first + last) + embed_s * first + head_s * last
                + stage_s * v)
    kinds = [(fixed(0), 1)] + ([(fixed(ranks - 1), 1)] if ranks > 1 else [])
    kinds += [(fixed(1), ranks - 2)] if ranks > 2 else []
    start = max(f for f, _ in kinds)
    if least_block_s <= 0:
        return start
    def holds(rho: float) -> int:  # the 1e-9 rounds capacity up: the bound stays a lower bound
        return sum(n * math.floor((rho - f) / least_block_s + 1e-9) for f, n in kinds if rho >= f)
    even = (blocks * least_block_s + sum(f * n for f, n in kinds)) / ranks
    best = math.inf
    for f, _ in kinds:
        lo = max(0, math.ceil((start - f) / least_block_s - 1e-9))
        hi = lo + blocks  # this kind alone holds N more blocks there
        j = _least(lambda j: holds(f + j * least_block_s) >= blocks, lo, hi,
                   math.ceil((even - f) / least_block_s))
        best = min(best, f + j * least_block_s)
    return max(start, best) * (1 - 1e-12)


def _least(pred, lo: int, hi: int, guess: int) -> int:
    """The least j in [lo, hi) with pred(j), or hi if there is none, for a pred that turns from
    false to true as j grows: what bisecting [lo, hi) finds, searched out from a guess."""
    if lo >= hi:
        return lo
    # the answer lies in [a, b]: pred is false below a, and true at b (or b = hi)
    j, step = min(max(guess, lo), hi - 1), 1
    if pred(j):
        b = j
        while b - step >= lo and pred(b - step):
            b, step = b - step, 2 * step
        a = max(lo, b - step + 1)
    else:
        a = j + 1
        while a + step - 1 < hi and not pred(a + step - 1):
            a, step = a + step, 2 * step
        b = min(hi, a + step - 1)
    while a < b:
        mid = (a + b) // 2
        a, b = (a, mid) if pred(mid) else (mid + 1, b)
    return a
