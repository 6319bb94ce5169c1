r"""The inner ILP: for a fixed mesh, micro-batching and pipeline schedule, how many blocks of each
strategy every pipeline stage holds.

The model is a chain  embed, block × N, head. Where its blocks are identical, instead of placing
each block we count blocks per (stage, strategy) (per (stage, run, strategy) when they form runs
of different kinds, below) — orders of magnitude fewer variables than a
per-layer placement, and exact: identical blocks inside a contiguous stage are interchangeable
(a stage's blocks are ordered by strategy, so a stage mixing k strategies reshards k − 1 times;
the per-strategy costs include their collectives, and resharding between tp layouts costs nothing
extra because every block boundary is replicated). Embed is pinned to stage 0 and head to the last
stage; the schedule places stage s on rank r(s) = s mod p (v stages per rank when interleaved).

Data (per micro-batch, from cost_model.layers.layer_cost):  t_k time fwd+bwd of one block under strategy
k, w_k its static bytes (weights, gradients, optimizer states), a_k its activation bytes, g_k its
gradient bytes, o_k its optimizer step (seconds per step); E, H the embed/head terms on the
first/last stage; c the p2p time of a stage boundary; q the runtime's own seconds per stage and
micro-batch (its per-action overheads, cluster.action_*: 0 in the presets); φ_r the activation sets rank r keeps alive at its peak, per stage it holds (the
schedule's in-flight count ÷ v: p − r for 1F1B, m for GPipe); M the memory limit.

Variables:  n[s,k] ∈ ℤ≥0, ρ ≥ 0 (slowest rank), σ ≥ 0 (slowest data-parallel sync);
            y[s,j] ∈ {0,1} for heterogeneous models only (below).

  minimise    α·Σ_s T_s + β·ρ + σ                                        `_objective`
  T_s       = Σ_k n[s,k]·t_k + E·[s = 0] + H·[s = S−1] + c·([s > 0] + [s < S−1]) + q   `_stage_time`
  ρ         ≥ Σ_{s on r} T_s                       ∀ rank r              `_add_bottleneck`
  ρ         ≥ ρ*  (the least ρ at which whole blocks fit, below)         `busiest_rank_floor`
  σ         ≥ a + b·G_r + H_r − κ·Σ_{s on r} T_s + τ_r + O_r       ∀ r   `_add_sync`
  σ         ≥ a + b·G_r + λ·H_r + τ_r + O_r                       ∀ r   `_add_sync`
     with G_r = Σ_{s on r} (Σ_k n[s,k]·g_k + grads of E, H),  H_r = a' + b'·G_r,
          O_r = Σ_{s on r} (Σ_k n[s,k]·o_k + o of E, H)
  Σ_s Σ_{k ∈ K_j} n[s,k] = N_j                     ∀ run j              `_add_cover`
  Σ_k n[s,k] ≥ 1                                   ∀ 0 < s < S − 1       `_add_cover`
  Σ_{s, k tensor-parallel} n[s,k] ≥ 1              if tp > 1             `_add_cover`
  ⌊N/S⌋ − [s ∈ ends] ≤ Σ_k n[s,k] ≤ ⌈N/S⌉             ∀ s, if interleaved   `_add_cover`
  Σ_{s on r} Σ_k n[s,k]·(w_k + γ·ℓ_k + μ_c(s)·a_k + ν_c(s)·g'_k) + E, H terms + X_r + ζ ≤ M
                                                   ∀ r, ∀ form (γ, μ, ν, ζ) `_add_memory`

Memory. A rank's peak is the largest of a few forms, each one row: μ counts the activation
sets each of its stages holds at a moment it could peak (after each forward of the schedule,
runtime.pipeline.generators.inflight_moments; φ_r on every stage when none are given); ℓ_k are
option k's lazy gradients, those no buffer holds (autograd makes them in the backward): on a
rank that runs every forward before its first backward they are absent at the activation peak
(γ = −1), or present with one set of its last stage freed (γ = 0); elsewhere γ = 0. X_r is the
largest temporary of any option the rank may hold (a constant; a plan reports its own layers').
Under ZB-H1 with split_backward "record" ν counts, per stage at the same moments (after each
forward and, then, after each I as well), the micro-batches whose W is still to come, each
holding the gradients I recorded for it (g'_k, BlockOption.record_bytes; ν = 0 on the first stage
and everywhere else).
Under ZeRO 2-3 each form comes twice: with ζ the whole weights of the unit in use, or with ζ the
whole transient (one or two units' gradients and weights, cost_model.layers.sharding) and one
set of every stage freed (μ − 1), as the unit's gradients appear only after its backward. With
16-bit weights one more form is the optimizer step's: every weight, gradient and state and no
activation set, the step's fp32 gradient copies beside them (σ of the static bytes, σ =
step_share): Σ_{s on r} Σ_k n[s,k]·(1 + σ)·w_k + E, H terms + X_r ≤ M. The
limit M is what the device leaves live tensors (cost_model.hardware.device_memory).

Heterogeneous blocks (`BlockRun`). The model is an ordered sequence of runs j = 0..R−1 of N_j
identical blocks; blocks of one kind are alike, each kind has its own options, and option k
belongs to exactly one run (K_j: run j's options — a kind occurring in several runs lists its
options once per run). A stage covers a contiguous range of blocks, so it holds a suffix of one
run, whole runs, then a prefix of another. With X[s,j] = Σ_{s' < s} Σ_{k ∈ K_j} n[s',k], the run-j
blocks before stage s, contiguity says: at each inner boundary s = 1..S−1 the blocks before it are
the runs before some run j*, whole, and a part of run j*. The binaries y[s,j] = [j* = j] say so:

  Σ_j y[s,j] = 1                                   ∀ 0 < s < S              `contiguity`
  X[s,j] ≤ N_j · Σ_{j' ≥ j} y[s,j']                 (no run-j block before the boundary if j > j*)
  X[s,j] ≥ N_j · Σ_{j' > j} y[s,j']                 (all of run j before it if j < j*)

X is non-decreasing in s because n ≥ 0, so the prefixes nest and every stage is the contiguous
range between two of them: stage s holds Σ_{k ∈ K_j} n[s,k] = X[s+1,j] − X[s,j] blocks of run j,
in run order (within a run, ordered by strategy, as above). With one run (identical blocks) the
rows are void and none are added: the problem is the one above with R(S − 1) binaries fewer.
The middle-stage symmetry breaking (`_add_cover`) is dropped when R > 1: stages that hold
different kinds are no longer interchangeable. The LP relaxation (solve(relax=True), the bound
the outer search orders and prunes configurations by) leaves the contiguity rows and y out:
fewer rows, so still a lower bound, and with y fractional they seldom raise it (DeepSeek-V3 on
1024 GPUs: every bound the same to 1e-14; the three-kind model of examples/bench_planner.py:
some 0.1% lower), while their prefix sums X hold most of the nonzeros, O(S²·R), so the
relaxation builds and solves in half the time. The times, memory and gradient terms are sums over
options, whatever their run, so every other row is unchanged; min_k t_k in ρ* is over all kinds.
Where a kind occurs in several runs (an alternating pattern), the runs of each kind are pooled
and the boundaries placed by position instead (planner.search.contiguity): the same plans, without
the equivalent choices of which of a stage's same-kind runs takes which strategy.

Interleaved stages hold even chunks (N blocks over S = v·p stages; the two end stages, which also
hold the embedding and the head, one block fewer at most), as Megatron-Core's equal layers per
virtual stage do: the schedule's closed form below prices only the slowest rank's sum, and that
holds when each rank's chunks are alike. With chunks uneven within a rank it does not: the
rank's fixed order of chunks makes it wait on the slower one (runtime.pipeline.simulator, 8 ranks
and 2 chunks each, 64 micro-batches: every rank's chunks 0.5 and 1.5 of a block run 1.31 times
the closed form, a rank balanced as (1, 1) throughout within 0.5%, end stages uneven by the
head within 0.6%), so the search, which can otherwise make every rank's sum equal with
uneven chunks, would price plans faster than they run.

(α, β) come from the schedule: 1F1B and GPipe (1, m − 1) — one micro-batch flows through every
stage, the other m − 1 are paced by the slowest; interleaved 1F1B (0, m + (p − 1)/v); ZB-H1
(0, m + (p − 1)/3), whose deferred weight-gradient work fills two thirds of the bubble. The data-
parallel all-reduce time is affine in bytes (a: latency terms, b: exposed seconds per byte), so σ is
linear; the optimizer step that follows it is linear in the blocks too, so σ bounds the slowest
rank's sync and step together. Where collectives run on their own stream beside compute (GPUs),
the part that can (H_r: the bucketed all-reduce, the reduce-scatters, ZeRO-3's prefetched
gathers) runs beside κ₀ micro-batch passes of the rank's compute, which it slows by the share s
of the GPU its kernels hold (Cluster.comm_sm_share): it costs max(s·H, H − (1 − s)·κ₀·ΣT), and
no less than one of the rank's U units' share H/U (the first gather or the last reduce has no
compute beside it). The two rows are that max made linear, with κ = (1 − s)·κ₀ and
λ = max(s, 1/U). On CPU ranks H is 0 and (a, b) hide the measured share dp_overlap instead. τ_r is the all-reduce that sums the gradients of weights the embedding and the head share
(a tied head) over their two ranks, on those ranks when they differ (runtime.training.tied), else 0.

Sharded data parallel (ZeRO level z over shard groups of n ranks, planner.search.zero) adds no variable
either: w_k becomes the bytes one rank holds of option k's weights, gradients and optimizer states
under z (cost_model.layers.sharding: w·f_w + g·f_g + K·f_o with f = 1/n for what z shards), M shrinks by
the whole-layer buffers levels 2-3 hold for a moment, and (a, b) are the level's collectives per
step (reduce-scatters once or per micro-batch, all-gathers after the step or before every use,
the replicate all-reduce of hybrid sharding), still affine in the rank's gradient bytes.

Expert parallelism (planner.search.experts) adds no variable: the problem is solved once per EP
size, with each MoE kind's options priced at that ep — t_k gains the four all-to-alls and the
imbalance's extra expert compute, the static bytes hold 1/ep of the expert weights (whole under
every ZeRO level), g_k the rank's gradients — and the fastest solution over the sizes wins.

The ρ floor is a valid inequality, not a restriction: rank r spends F_r (its ends and p2p) plus
at least min_k t_k per block it holds, so within ρ it holds at most ⌊(ρ − F_r)/min_k t_k⌋ blocks,
and together the ranks must hold all N. The LP relaxation would otherwise spread fractional
blocks (1.5 per rank for 96 blocks on 64 ranks, or 2.7 on a first rank that also runs the
embedding) and bound far below any integer plan; with the floor the relaxation — and so branch
and bound — sees the rounding. `solve` also takes a cutoff (the plan to beat) as the row
objective ≤ cutoff, so HiGHS drops every branch that cannot beat it and answers "cutoff" when
none can: that is how the outer search skips a hopeless configuration, usually after one LP.

With objective="memory" the same constraints (without the memory cap) minimise the peak
memory instead, which is how an infeasible request learns the smallest memory that would fit.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import pulp

from planner.search import contiguity, highs
from planner.search.contiguity import BlockRun  # noqa: F401 - ilp.BlockRun is the interface
from planner.search.linear import Lin as _Lin, add_row as _add_row, count as _count
from planner.search.linear import lin_sum as _lin_sum, scaled as _scaled, var as _var
from planner.search.rank_floor import busiest_rank_floor
from planner.search.rank_memory import RankParts, rank_forms, rank_moments, rank_parts  # noqa: F401
from planner.search.rank_memory import stage_ends as _ends


@dataclass(frozen=True)
class BlockOption:
    name: str            # strategy text
    time_s: float        # fwd + bwd of one block, one micro-batch
    static_bytes: float  # weights + grads + optimizer states
    act_bytes: float     # per micro-batch in flight
    grad_bytes: float    # gradient bytes all-reduced over dp
    step_s: float = 0.0  # the optimizer step over its parameters, once per step
    # of its gradients, those no buffer holds between backwards (autograd makes them in the
    # backward): absent at a rank's activation peak when no forward follows a backward there
    lazy_grad_bytes: float = 0.0
    # the gradients ZB-H1's I records for W under split_backward "record", per micro-batch
    # (LayerCost.record_bytes): alive from I until W, on every stage but the first
    record_bytes: float = 0.0


@dataclass(frozen=True)
class EndLayer:
    time_s: float
    static_bytes: float
    act_bytes: float
    grad_bytes: float
    step_s: float = 0.0
    lazy_grad_bytes: float = 0.0  # BlockOption.lazy_grad_bytes
    record_bytes: float = 0.0     # BlockOption.record_bytes


@dataclass(frozen=True)
class StageProblem:
    blocks: int                       # N; with runs, their total (set from them)
    options: tuple[BlockOption, ...]  # with runs, every run's options in run order (set from them)
    embed: EndLayer
    head: EndLayer
    ranks: int                 # p
    stages: int                # S = p·v
    sum_weight: float          # α
    max_weight: float          # β
    p2p_s: float
    memory_limit: float
    sync_alpha_s: float        # latency part of one data-parallel all-reduce (0 if dp == 1)
    sync_s_per_byte: float     # bandwidth part, exposed share included
    act_factor: tuple[float, ...]   # φ_r per rank
    needs_tp: bool = False          # tp > 1: a mesh whose tp ranks all replicate is no plan
    tie_s: float = 0.0              # τ: summing tied embed/head gradients across their ranks
    runs: tuple[BlockRun, ...] = ()  # heterogeneous blocks, in model order; () = one run
    stage_s: float = 0.0            # q: the runtime's own seconds per stage and micro-batch
    # The data-parallel collectives that run beside compute (a' + b'·G, cost_model.layers.sharding
    # .SyncParts): exposed where they outlast κ micro-batch passes of the rank's compute (less
    # the compute they slow), and by at least a share λ of them
    hide_alpha_s: float = 0.0       # a'
    hide_s_per_byte: float = 0.0    # b'
    hide_beside: float = 0.0        # κ
    hide_least: float = 1.0         # λ
    # The per-rank memory terms beyond the blocks' (module docstring, "Memory"): X_r, the
    # largest temporary of the rank's layers; lazy_r, no forward follows a backward on rank r
    # (its options' lazy gradients are absent at its activation peak)
    rank_temp: tuple[float, ...] = ()
    lazy_grads: tuple[bool, ...] = ()
    # W of a split backward (ZB-H1) makes the lazy gradients beside every set (`rank_forms`)
    split_w: bool = False
    # ZeRO levels 2-3 (cost_model.layers.sharding.peak_buffers): the whole weights of the unit
    # in use at the activation peak, and the whole transient, which adds less one set
    zero_in_use: float = 0.0
    zero_whole: float = 0.0
    # the optimizer step's fp32 gradient copies, per byte of static (ModelCosts.step_share)
    step_share: float = 0.0
    # per rank, the activation-set counts per local stage at its candidate peaks (`rank_moments`;
    # () : φ_r on every stage)
    moments: tuple = ()
    # runs pooled by kind (contiguity.pooled): each block's kind, an index into runs, in model
    # order; () : the runs are in model order
    order: tuple[int, ...] = ()

    def __post_init__(self):
        if self.runs:  # blocks and options follow from the runs; replace(runs=...) re-derives them
            object.__setattr__(self, "blocks", sum(r.count for r in self.runs))
            object.__setattr__(self, "options", tuple(o for r in self.runs for o in r.options))

    def block_runs(self) -> tuple[BlockRun, ...]:
        return self.runs or (BlockRun("block", self.blocks, self.options),)

    def run_options(self) -> list[range]:
        """K_j: the indices into `options` of each run's options."""
        ranges, first = [], 0
        for run in self.block_runs():
            ranges.append(range(first, first + len(run.options)))
            first += len(run.options)
        return ranges

    def tie_time(self, rank: int) -> float:
        """τ_r: on the ranks of the first and the last stage, when they are two."""
        ends = {self.rank_of(0), self.rank_of(self.stages - 1)}
        return self.tie_s if len(ends) > 1 and rank in ends else 0.0

    def tp_options(self) -> list[int]:
        return [k for k, o in enumerate(self.options) if "tp" in o.name.split("+")]

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> range:
        return range(rank, self.stages, self.ranks)


def schedule_weights(name: str, p: int, m: int, v: int = 1) -> tuple[float, float]:
    """(α, β) of the objective for a schedule; see the module docstring."""
    if name in ("1f1b", "gpipe"):
        return 1.0, float(m - 1)
    if name == "interleaved-1f1b":
        return 0.0, m + (p - 1) / v
    if name == "zb-h1":
        return 0.0, m + (p - 1) / 3
    raise ValueError(f"unknown schedule {name!r}")


@dataclass(frozen=True)
class Solution:
    counts: tuple[tuple[int, ...], ...]   # counts[s][k]
    objective: float
    status: str    # "optimal" | "feasible" (stopped with a gap) | "infeasible" | "cutoff" (none
    #                beats the cutoff) | "unsolved" (stopped before any solution)
    gap: float
    seconds: float
    bound: float = math.nan               # proven lower bound on the optimum (nan: none known)
    stop: str = ""                        # "node limit" | "time limit" | "" (highs.run)


def solve(problem: StageProblem, objective: str = "time", time_limit_s: float = 30.0,
          solver: str = "highs", relax: bool = False, gap: float = 1e-6,
          cutoff: float = math.inf) -> Solution:
    """Solve the ILP (or, with relax, its LP relaxation: a lower bound in milliseconds). With a
    finite cutoff (objective "time" only) just solutions below it count: status "cutoff" says
    there is none, whether or not the problem has a solution at all."""
    start = time.perf_counter()
    pooled = contiguity.pooled(problem)
    if pooled is not None:  # runs that repeat a kind: solved per kind, given back per run
        solution = solve(pooled, objective, time_limit_s, solver, relax, gap, cutoff)
        return _unpooled(problem, pooled, solution)
    if problem.blocks < max(0, problem.stages - 2):
        return Solution((), math.inf, "infeasible", 0.0, 0.0)
    cutoff = cutoff if objective == "time" and not relax else math.inf
    prob, n = _build(problem, objective, relax, cutoff)
    unit = _byte_unit(problem) if objective == "memory" else _time_unit(problem)
    status, gap, bound, stop = highs.run(prob, solver, time_limit_s, gap)
    bound *= unit
    if status == "infeasible" and cutoff < math.inf:
        status, bound = "cutoff", cutoff
    if status not in ("optimal", "feasible"):
        return Solution((), math.inf, status, 0.0, time.perf_counter() - start, bound, stop)
    value = pulp.value(prob.objective) * unit
    if relax:
        return Solution((), value, "relaxed", 0.0, time.perf_counter() - start, value)
    counts = tuple(tuple(int(round(n[s, k].value() or 0)) for k in range(len(problem.options)))
                   for s in range(problem.stages))
    bound = value if status == "optimal" else bound
    return Solution(counts, value, status, gap, time.perf_counter() - start, bound, stop)


def polish(problem: StageProblem, solution: Solution, time_limit_s: float = 1.0) -> Solution:
    """Among assignments as fast as `solution`, one with the least total stage time Σ_s T_s.

    When the objective weighs only the slowest rank (interleaved, ZB-H1) every stage off the
    critical rank may take any strategy that fits, and the solver returns an arbitrary mix (tp
    here, tp+sp there). Fixing the objective at the optimum and minimising Σ_s T_s makes those
    stages choose their fastest strategy too: the same predicted time, a plan that reads as
    intended and wastes no compute. Returns `solution` itself if the second solve finds nothing."""
    if solution.status not in ("optimal", "feasible"):
        return solution
    pooled = contiguity.pooled(problem)
    if pooled is not None:
        polished = polish(pooled, replace(solution, counts=()), time_limit_s)
        return solution if not polished.counts else _unpooled(problem, pooled, polished)
    prob, n = _build(problem, "time", relax=False,
                     cutoff=solution.objective * (1 + 1e-9) + 1e-12)
    prob.setObjective(_lin_sum(_stage_time(problem, n, s)
                               for s in range(problem.stages)).affine())
    status, _, _, _ = highs.run(prob, "highs", time_limit_s, 1e-6)
    if status not in ("optimal", "feasible"):
        return solution
    counts = tuple(tuple(int(round(n[s, k].value() or 0)) for k in range(len(problem.options)))
                   for s in range(problem.stages))
    value = breakdown(problem, counts).iteration_s
    if value > solution.objective * (1 + 1e-9) + 1e-12:
        return solution
    return replace(solution, counts=counts, objective=value)


def _unpooled(problem: StageProblem, pooled: StageProblem, solution: Solution) -> Solution:
    if not solution.counts:
        return solution
    return replace(solution, counts=contiguity.unpooled(problem, pooled, solution.counts))


def _build(problem: StageProblem, objective: str, relax: bool, cutoff: float = math.inf):
    """The pulp model of the module docstring, and its n[s,k] variables. The LP relaxation
    (relax) leaves out the contiguity rows (`contiguity`): see the module docstring."""
    prob = pulp.LpProblem("stages", pulp.LpMinimize)
    cat = "Continuous" if relax else "Integer"
    n = {(s, k): _var(prob, f"n_{s}_{k}", problem.blocks, cat)
         for s in range(problem.stages) for k in range(len(problem.options))}
    times = [_stage_time(problem, n, s) for s in range(problem.stages)]
    mems = [_rank_memory(problem, n, r) for r in range(problem.ranks)]
    _add_cover(prob, problem, n)
    if not relax:
        contiguity.add_order(prob, problem, n, cat)
    if objective == "time":
        rho = _add_bottleneck(prob, problem, times)
        sigma = _add_sync(prob, problem, n, times)
        _add_memory(prob, problem, mems)
        prob.setObjective(_objective(problem, times, rho, sigma).affine())
        if cutoff < math.inf:
            # A row, not HiGHS's objective_bound option, which 1.16 does not always honour.
            _add_row(prob, _objective(problem, times, rho, sigma), pulp.LpConstraintLE,
                     cutoff / _time_unit(problem), "cutoff")
    else:
        peak = _Lin({_var(prob, "peak"): 1}, 0)
        for r, forms in enumerate(mems):
            for i, mem in enumerate(forms):
                _add_row(prob, peak, pulp.LpConstraintGE, mem, f"peak_{r}_{i}")
        prob.setObjective(peak.affine())
    return prob, n


@dataclass(frozen=True)
class Breakdown:
    """Every term of the objective for one assignment, in plain numbers."""
    stage_s: tuple[float, ...]    # T_s
    rank_s: tuple[float, ...]     # Σ_{s on r} T_s
    rank_bytes: tuple[float, ...]  # peak memory of each rank
    sync_s: float                 # σ: the slowest rank's exposed all-reduce
    iteration_s: float            # α·Σ_s T_s + β·ρ + σ; infinite when tp > 1 but no block uses tp

    @property
    def busiest(self) -> int:
        return self.rank_s.index(max(self.rank_s))


def breakdown(problem: StageProblem, counts) -> Breakdown:
    """The objective's terms for a block assignment, computed in plain Python from the same terms
    as the ILP: a brute-force enumeration over this checks the solver, and a plan's prediction
    reads its parts from here."""
    times = tuple(stage_time(problem, counts, s) for s in range(problem.stages))
    rank_times, mems, syncs = [], [], []
    for r in range(problem.ranks):
        rank_times.append(sum(times[s] for s in problem.stages_of(r)))
        mem, grads, steps = _rank_load(problem, counts, r)
        mems.append(mem)
        syncs.append(_sync_time(problem, grads, rank_times[r]) + problem.tie_time(r) + steps)
    iteration = problem.sum_weight * sum(times) + problem.max_weight * max(rank_times) + max(syncs)
    if problem.needs_tp and not any(counts[s][k] for s in range(problem.stages)
                                    for k in problem.tp_options()):
        iteration = float("inf")
    return Breakdown(times, tuple(rank_times), tuple(mems), max(syncs), iteration)


def evaluate(problem: StageProblem, counts) -> tuple[float, float]:
    """(iteration time, peak memory) of a block assignment."""
    parts = breakdown(problem, counts)
    return parts.iteration_s, max(parts.rank_bytes)


def _rank_load(problem: StageProblem, counts, r: int) -> tuple[float, float, float]:
    """(peak memory, gradient bytes, optimizer seconds) of rank r."""
    parts = rank_parts(problem, counts, r)
    return max(parts.peaks()), parts.grads, parts.steps


def stage_time(problem: StageProblem, counts, s: int) -> float:
    """T_s for a concrete assignment (seconds per micro-batch, p2p included)."""
    t = sum(c * o.time_s for c, o in zip(counts[s], problem.options))
    return t + sum(e.time_s for e in _ends(problem, s)) + _p2p(problem, s) + problem.stage_s


def _sync_time(problem: StageProblem, grad_bytes: float, rank_s: float = 0.0) -> float:
    """Exposed seconds of a rank's data-parallel collectives for its gradient bytes, beside
    `rank_s` seconds of its compute per micro-batch: a + b·G + max(λ·H, H − κ·rank_s) with
    H = a' + b'·G the part that runs beside compute."""
    exposed = 0.0
    if problem.sync_alpha_s or problem.sync_s_per_byte:
        exposed = problem.sync_alpha_s + problem.sync_s_per_byte * grad_bytes
    hideable = problem.hide_alpha_s + problem.hide_s_per_byte * grad_bytes
    if hideable:
        exposed += max(problem.hide_least * hideable, hideable - problem.hide_beside * rank_s)
    return exposed


def _p2p(problem: StageProblem, s: int) -> float:
    return problem.p2p_s * ((s > 0) + (s < problem.stages - 1))


def _stage_time(problem: StageProblem, n, s: int) -> _Lin:
    """T_s in units of _time_unit."""
    fixed = sum(e.time_s for e in _ends(problem, s)) + _p2p(problem, s) + problem.stage_s
    unit = _time_unit(problem)
    options = range(len(problem.options))
    return _Lin(_scaled((n[s, k] for k in options), (o.time_s / unit for o in problem.options)),
                fixed / unit)


def _time_unit(problem: StageProblem) -> float:
    """Times enter the model in units of the slowest block: in seconds, a 1 ms block sits at
    the solver's feasibility tolerance (1e-7) times 1e4, and HiGHS was seen to let a rank run
    0.5 µs past ρ — a 2e-5 error in the objective, enough to pick a worse plan."""
    return max([o.time_s for o in problem.options] + [1e-30])


def _byte_unit(problem: StageProblem) -> float:
    """Bytes enter the model in units of the largest per-block amount: coefficients of 1e10
    beside times of 1e-1 would make the solver's tolerances meaningless and its search slow."""
    sizes = [o.static_bytes + o.act_bytes + o.grad_bytes for o in problem.options]
    return max(sizes + [1e-30])


def _rank_memory(problem: StageProblem, n, r: int) -> list:
    """Rank r's peak-memory forms (`rank_forms`, linear in n), in units of _byte_unit."""
    unit = _byte_unit(problem)
    lazy = bool(problem.lazy_grads) and problem.lazy_grads[r] and any(
        o.lazy_grad_bytes for o in (*problem.options, problem.embed, problem.head))
    temp = problem.rank_temp[r] if problem.rank_temp else 0.0
    local = len(problem.stages_of(r))
    forms = [(1.0, *form) for form in rank_forms(rank_moments(problem, r), lazy,
                                                  problem.zero_in_use, problem.zero_whole,
                                                  local, problem.split_w and r > 0)]
    if problem.step_share:   # the optimizer step: static bytes and their share, no activations
        none = (0.0,) * local
        forms.append((1 + problem.step_share, 0.0, none, none, 0.0, 1.0))
    rows = []
    for w, g, factors, kept, extra, with_temp in forms:
        memory = _Lin({}, (with_temp * temp + extra) / unit)
        for s, a, b in zip(problem.stages_of(r), factors, kept):
            def load(o) -> float:
                return (w * o.static_bytes + g * o.lazy_grad_bytes + a * o.act_bytes
                        + b * o.record_bytes) / unit
            per_block = [load(o) for o in problem.options]
            memory.add(_Lin(_scaled((n[s, k] for k in range(len(per_block))), per_block)))
            for e in _ends(problem, s):
                memory.add(load(e))
        rows.append(memory)
    return rows


def _add_cover(prob, problem: StageProblem, n) -> None:
    EQ, GE = pulp.LpConstraintEQ, pulp.LpConstraintGE
    for j, (run, ks) in enumerate(zip(problem.block_runs(), problem.run_options())):
        _add_row(prob, _count(n[s, k] for s in range(problem.stages) for k in ks), EQ,
                 run.count, f"all_blocks_placed_{j}")
    if problem.needs_tp:
        _add_row(prob, _count(n[s, k] for s in range(problem.stages)
                              for k in problem.tp_options()), GE, 1, "some_block_uses_tp")
    size = [_count(n[s, k] for k in range(len(problem.options))) for s in range(problem.stages)]
    for s in range(1, problem.stages - 1):
        _add_row(prob, size[s], GE, 1, f"nonempty_{s}")
    if problem.stages > problem.ranks:  # interleaved: even chunks (module docstring)
        lo, hi = problem.blocks // problem.stages, -(-problem.blocks // problem.stages)
        for s in range(problem.stages):
            ends = s in (0, problem.stages - 1)
            _add_row(prob, size[s], pulp.LpConstraintLE, hi, f"even_chunk_{s}")
            _add_row(prob, size[s], GE, max(lo - ends, 0), f"even_chunk_floor_{s}")
    # Symmetry breaking: middle stages that are alike (one stage per rank, same activation
    # factor) can be permuted without changing time or memory, so order them by size; without
    # this the solver explores every permutation of equivalent stages.
    for s in range(1, problem.stages - 2):
        if len(problem.block_runs()) > 1:
            break  # stages holding different kinds are not interchangeable
        if problem.stages == problem.ranks and problem.act_factor[s] == problem.act_factor[s + 1]:
            _add_row(prob, size[s], GE, size[s + 1], f"symmetry_{s}")


def rank_floor(problem: StageProblem) -> float:
    """A lower bound on the slowest rank's time, ρ (see the module docstring)."""
    return busiest_rank_floor(problem.blocks, problem.ranks, problem.stages,
                              min(o.time_s for o in problem.options), problem.embed.time_s,
                              problem.head.time_s, problem.p2p_s, problem.stage_s)


def _add_bottleneck(prob, problem: StageProblem, times):
    rho = _var(prob, "rho")
    rho.lowBound = rank_floor(problem) / _time_unit(problem)
    for r in range(problem.ranks):
        _add_row(prob, _Lin({rho: 1}, 0), pulp.LpConstraintGE,
                 _lin_sum(times[s] for s in problem.stages_of(r)), f"bottleneck_{r}")
    return rho


def _add_sync(prob, problem: StageProblem, n, times):
    sigma = _var(prob, "sigma")
    steps = any(o.step_s for o in (*problem.options, problem.embed, problem.head))
    hides = problem.hide_alpha_s or problem.hide_s_per_byte
    if problem.sync_s_per_byte == 0 and problem.sync_alpha_s == 0 and problem.tie_s == 0 \
            and not steps and not hides:
        return sigma
    unit, seconds = _byte_unit(problem), _time_unit(problem)
    # A block's coefficient in the rows is the same on every rank and only the constants (end
    # layers, τ_r) differ: work the terms out once, over option indices k, and each rank's
    # constants with `_sync_sides` on constant-only expressions. Terms and constants never mix
    # in this arithmetic, so the rows are those of `_sync_sides` on each rank's own sums.
    per_block = _sync_sides(problem, _Lin(_scaled(range(len(problem.options)),
                                                  (o.grad_bytes / unit for o in problem.options))),
                            _Lin(_scaled(range(len(problem.options)),
                                         (o.step_s / seconds for o in problem.options))),
                            _Lin(_scaled(range(len(problem.options)),
                                         (o.time_s / seconds for o in problem.options))), 0.0)
    at_least = _Lin({sigma: 1}, 0)
    names = ("sync", "sync_least")
    for r in range(problem.ranks):
        grads, optimizer = _Lin(), _Lin()
        for s in problem.stages_of(r):
            for e in _ends(problem, s):
                grads.add(e.grad_bytes / unit)
                optimizer.add(e.step_s / seconds)
        rank_time = _lin_sum(times[s].constant for s in problem.stages_of(r))
        alpha = problem.sync_alpha_s + problem.tie_time(r)
        constants = _sync_sides(problem, grads, optimizer, _Lin(constant=rank_time.constant),
                                alpha)
        for name, terms, constant in zip(names, per_block, constants):
            side = _Lin({n[s, k]: c for s in problem.stages_of(r) for k, c in terms.terms.items()},
                        constant.constant)
            _add_row(prob, at_least, pulp.LpConstraintGE, side, f"{name}_{r}")
    return sigma


def _sync_sides(problem: StageProblem, grads: _Lin, optimizer: _Lin, rank_time: _Lin,
                alpha: float) -> list[_Lin]:
    """The right-hand sides of a rank's rows σ ≥ ... (`_add_sync`), in units of _time_unit,
    from its gradient bytes (units of _byte_unit), optimizer seconds and T_s sum (time units)."""
    unit, seconds = _byte_unit(problem), _time_unit(problem)
    base = (alpha / seconds + problem.sync_s_per_byte * unit / seconds * grads
            + optimizer)
    if not (problem.hide_alpha_s or problem.hide_s_per_byte):
        return [base]
    hideable = problem.hide_alpha_s / seconds + problem.hide_s_per_byte * unit / seconds * grads
    return [base + hideable - problem.hide_beside * rank_time,
            base + problem.hide_least * hideable]


def _add_memory(prob, problem: StageProblem, mems) -> None:
    for r, forms in enumerate(mems):
        for i, mem in enumerate(forms):
            _add_row(prob, mem, pulp.LpConstraintLE, problem.memory_limit / _byte_unit(problem),
                     f"memory_{r}_{i}")


def _objective(problem: StageProblem, times, rho, sigma) -> _Lin:
    return (problem.sum_weight * _lin_sum(times) + problem.max_weight * _Lin({rho: 1}, 0)
            + _Lin({sigma: 1}, 0))
