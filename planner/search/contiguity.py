"""The rows that keep every pipeline stage a contiguous range of blocks when the blocks are of
several kinds (planner.search.ilp's docstring, "Heterogeneous blocks"), in one of two forms that
have the same solutions.

By run (`add_run_order`): counts per (stage, run, strategy) and a binary y[s,j] per (inner
boundary, run) saying in which run the boundary falls: (S − 1)·R binaries. Right for a few long
runs (3 dense blocks then 58 of experts: R = 2).

By position (`pooled`, `add_position_order`), for runs that repeat a kind (R > K kinds: an
alternating pattern has R = N): the runs of one kind are pooled, so the counts are per (stage,
kind, strategy), and a binary u[s,b] says that inner boundary s falls at or after block b
(b = 1..N), a staircase:

  u[s,b+1] ≤ u[s,b],   u[s,b] ≤ u[s+1,b]             (boundaries are positions, in order)
  X[s,κ] = Σ_{i of kind κ} u[s,i+1]                   ∀ 0 < s < S, ∀ kind κ

with X[s,κ] the kind-κ blocks of the stages before s: block i is before boundary s exactly when
u[s,i+1] = 1, so each stage holds, of every kind, exactly the blocks of its range. The by-run
form reaches the same plans, but a stage holding five kind-0 runs can recompute any one of them:
branch and bound enumerates those equivalent choices. GPT-OSS 120B (36 blocks, two kinds
alternating; 64 GPUs, pp=4 fixed) took HiGHS 1109 nodes by run, and a 1 s time limit stopped it
at a gap that differed from one process to the next; pooled, it is solved at the root. `unpooled`
gives a solution back per run: a stage's blocks of a kind take its strategies in option order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pulp

from planner.search.linear import Lin, add_row, count, var


@dataclass(frozen=True)
class BlockRun:
    """N consecutive identical blocks of one kind and that kind's options (ilp's docstring)."""
    kind: str
    count: int
    options: tuple

    def __post_init__(self):
        if self.count < 1 or not self.options:
            raise ValueError(f"run of {self.kind!r} blocks needs count >= 1 and an option, got "
                             f"count {self.count} and {len(self.options)} options")


def pooled(problem):
    """The problem with its runs pooled by kind (`order` holds each block's kind, in model
    order), or None where no kind occurs in two runs. Runs of one kind share their options."""
    runs = problem.runs
    kinds = list(dict.fromkeys((r.kind, r.options) for r in runs))
    if len(kinds) == len(runs) or problem.order:
        return None
    totals = [sum(r.count for r in runs if (r.kind, r.options) == k) for k in kinds]
    order = tuple(kinds.index((r.kind, r.options)) for r in runs for _ in range(r.count))
    return replace(problem, runs=tuple(BlockRun(kind, n, options)
                                       for (kind, options), n in zip(kinds, totals)),
                   order=order)


def unpooled(problem, pooled_problem, counts) -> tuple[tuple[int, ...], ...]:
    """`counts` of the pooled problem (per stage, per kind option) as counts of `problem` (per
    stage, per run option): each stage's range of blocks, in model order, takes its kind's
    strategies in option order."""
    kind_of = {(r.kind, r.options): i for i, r in enumerate(pooled_problem.runs)}
    kind_first = [rng.start for rng in pooled_problem.run_options()]
    run_first = [rng.start for rng in problem.run_options()]
    run_of = [j for j, r in enumerate(problem.block_runs()) for _ in range(r.count)]
    result, position = [], 0
    for stage in counts:
        left = list(stage)
        mine = [0] * len(problem.options)
        for _ in range(sum(stage)):
            j = run_of[position]
            kind = kind_of[problem.runs[j].kind, problem.runs[j].options]
            first = kind_first[kind]
            strategy = next(i for i in range(len(problem.runs[j].options)) if left[first + i])
            left[first + strategy] -= 1
            mine[run_first[j] + strategy] += 1
            position += 1
        result.append(tuple(mine))
    return tuple(result)


def add_order(prob, problem, n, cat: str = "Integer") -> None:
    """Contiguity over runs, in the problem's form (module docstring)."""
    if problem.order:
        add_position_order(prob, problem, n, cat)
    elif len(problem.block_runs()) > 1:
        add_run_order(prob, problem, n, cat)


def add_run_order(prob, problem, n, cat: str) -> None:
    """y[s,j]: inner boundary s falls in run j (ilp's docstring)."""
    runs, ranges = problem.block_runs(), problem.run_options()
    before = [{} for _ in runs]  # X[s,j]: the run-j blocks of the stages before s, as {n: 1}
    for s in range(1, problem.stages):
        y = [var(prob, f"y_{s}_{j}", 1, cat) for j in range(len(runs))]
        add_row(prob, count(y), pulp.LpConstraintEQ, 1, f"boundary_{s}")
        for j, (run, ks) in enumerate(zip(runs, ranges)):
            before[j] = {**before[j], **dict.fromkeys((n[s - 1, k] for k in ks), 1)}
            add_row(prob, Lin(before[j]), pulp.LpConstraintLE,
                    run.count * count(y[j:]), f"nothing_of_{j}_before_{s}")
            add_row(prob, Lin(before[j]), pulp.LpConstraintGE,
                    run.count * count(y[j + 1:]), f"all_of_{j}_before_{s}")


def add_position_order(prob, problem, n, cat: str) -> None:
    """u[s,b]: inner boundary s falls at or after block b (module docstring)."""
    blocks, stages = problem.blocks, problem.stages
    u = {}
    for s in range(1, stages):
        # inner stages hold a block each (ilp._add_cover): boundary s is at least s − 1 blocks
        # in and leaves S − 1 − s blocks after it; outside that, u is a constant
        low, high = s - 1, blocks - (stages - 1 - s)
        for b in range(1, blocks + 1):
            u[s, b] = 1 if b <= low else 0 if b > high else var(prob, f"u_{s}_{b}", 1, cat)
    free = [(s, b) for (s, b), x in u.items() if not isinstance(x, int)]
    for s, b in free:   # rows with a constant side hold by the bounds alone
        if b < blocks and not isinstance(u[s, b + 1], int):
            add_row(prob, Lin({u[s, b + 1]: 1}), pulp.LpConstraintLE, Lin({u[s, b]: 1}),
                    f"boundary_{s}_from_{b}")
        if s + 1 < stages and not isinstance(u[s + 1, b], int):
            add_row(prob, Lin({u[s, b]: 1}), pulp.LpConstraintLE, Lin({u[s + 1, b]: 1}),
                    f"boundaries_{s}_in_order_at_{b}")
    before = [{} for _ in problem.runs]
    for s in range(1, stages):
        for kind, ks in enumerate(problem.run_options()):
            before[kind] = {**before[kind], **dict.fromkeys((n[s - 1, k] for k in ks), 1)}
            at = Lin()
            for i in (i for i, k in enumerate(problem.order) if k == kind):
                at.add(Lin({u[s, i + 1]: 1}) if not isinstance(u[s, i + 1], int) else u[s, i + 1])
            add_row(prob, Lin(before[kind]), pulp.LpConstraintEQ, at, f"kind_{kind}_before_{s}")
