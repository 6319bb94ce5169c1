r"""The inner ILP: for a fixed mesh (dp, tp, pp) and micro-batching (b, m), how many blocks of
each strategy every pipeline stage holds.

The model is a chain  embed, block × N, head  whose blocks are identical, so instead of placing
each block we count blocks per (stage, strategy) — orders of magnitude fewer variables than a
per-layer placement, and exact: identical blocks in a contiguous stage are interchangeable.
Embed is pinned to stage 0 and head to stage p−1 (stages are contiguous and non-empty).

Data (per micro-batch, from cost_model.layer_cost):  t_k time fwd+bwd of one block under strategy
k, w_k its static bytes (weights, gradients, optimizer states), a_k its activation bytes, g_k its
gradient bytes; E_s, H_s the embed/head terms on the stages that hold them; c the p2p time of a
boundary; f_s = min(p − s, m) micro-batches in flight on stage s under 1F1B; M the memory limit.

Variables:  n[s,k] ∈ ℤ≥0, τ ≥ 0 (slowest stage), σ ≥ 0 (slowest data-parallel sync).

  minimise    Σ_s T_s + (m − 1)·τ + σ                                   objective: `_objective`
  T_s       = Σ_k n[s,k]·t_k + E_s + H_s + c·[s > 0] + c·[s < p − 1]    stage time: `_stage_time`
  τ         ≥ T_s                                 ∀s                    `_add_bottleneck`
  σ         ≥ (1 − overlap)·allreduce_dp(Σ_k n[s,k]·g_k + grads of E_s, H_s)   ∀s   `_add_sync`
  Σ_{s,k} n[s,k] = N                                                    `_add_cover`
  Σ_k n[s,k] ≥ 1                                  ∀ 0 < s < p − 1       `_add_cover`
  Σ_k n[s,k]·(w_k + f_s·a_k) + static/activation bytes of E_s, H_s ≤ M   ∀s   `_add_memory`

Σ_s T_s + (m − 1)·τ is the 1F1B iteration time: one micro-batch flows through every stage, the
other m − 1 are paced by the slowest stage. The all-reduce time is affine in bytes, so σ is linear.
With objective="memory" the same constraints (without the memory cap) minimise the peak memory
instead, which is how an infeasible request learns the smallest memory that would fit.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import pulp


@dataclass(frozen=True)
class BlockOption:
    name: str            # strategy text
    time_s: float        # fwd + bwd of one block, one micro-batch
    static_bytes: float  # weights + grads + optimizer states
    act_bytes: float     # per micro-batch in flight
    grad_bytes: float    # gradient bytes all-reduced over dp


@dataclass(frozen=True)
class EndLayer:
    time_s: float
    static_bytes: float
    act_bytes: float
    grad_bytes: float


@dataclass(frozen=True)
class StageProblem:
    blocks: int
    options: tuple[BlockOption, ...]
    embed: EndLayer
    head: EndLayer
    pp: int
    microbatches: int
    p2p_s: float
    memory_limit: float
    sync_alpha_s: float        # latency part of one data-parallel all-reduce (0 if dp == 1)
    sync_s_per_byte: float     # bandwidth part, exposed share included
    inflight: tuple[int, ...]  # micro-batches alive per stage (schedule-dependent)


@dataclass(frozen=True)
class Solution:
    counts: tuple[tuple[int, ...], ...]   # counts[s][k]
    objective: float
    status: str                           # "optimal" | "feasible" (time limit) | "infeasible"
    gap: float
    seconds: float


def solve(problem: StageProblem, objective: str = "time", time_limit_s: float = 30.0,
          solver: str = "highs") -> Solution:
    start = time.perf_counter()
    if problem.blocks < max(0, problem.pp - 2):
        return Solution((), float("inf"), "infeasible", 0.0, 0.0)
    prob = pulp.LpProblem("stages", pulp.LpMinimize)
    p, options = problem.pp, problem.options
    n = {(s, k): _var(prob, f"n_{s}_{k}", problem.blocks, "Integer")
         for s in range(p) for k in range(len(options))}
    times = [_stage_time(problem, n, s) for s in range(p)]
    mems = [_stage_memory(problem, n, s) for s in range(p)]
    _add_cover(prob, problem, n)
    if objective == "time":
        tau = _add_bottleneck(prob, times)
        sigma = _add_sync(prob, problem, n)
        _add_memory(prob, problem, mems)
        prob += _objective(times, tau, sigma, problem.microbatches)
    else:
        peak = _var(prob, "peak")
        for s, mem in enumerate(mems):
            prob += peak >= mem, f"peak_{s}"
        prob += peak
    status, gap = _run(prob, solver, time_limit_s)
    if status == "infeasible":
        return Solution((), float("inf"), status, 0.0, time.perf_counter() - start)
    counts = tuple(tuple(int(round(n[s, k].value() or 0)) for k in range(len(options)))
                   for s in range(p))
    return Solution(counts, pulp.value(prob.objective), status, gap, time.perf_counter() - start)


def evaluate(problem: StageProblem, counts) -> tuple[float, float]:
    """(iteration time, peak memory) of a block assignment, computed in plain Python from the
    same terms as the ILP: a brute-force enumeration over this checks the solver."""
    p, opts = problem.pp, problem.options
    times, mems, syncs = [], [], []
    for s in range(p):
        ends = _ends(problem, s)
        f = problem.inflight[s]
        t = sum(c * o.time_s for c, o in zip(counts[s], opts)) + sum(e.time_s for e in ends)
        times.append(t + problem.p2p_s * ((s > 0) + (s < p - 1)))
        mems.append(sum(c * (o.static_bytes + f * o.act_bytes) for c, o in zip(counts[s], opts))
                    + sum(e.static_bytes + f * e.act_bytes for e in ends))
        grads = sum(c * o.grad_bytes for c, o in zip(counts[s], opts))
        grads += sum(e.grad_bytes for e in ends)
        syncs.append(problem.sync_alpha_s + problem.sync_s_per_byte * grads
                     if problem.sync_s_per_byte or problem.sync_alpha_s else 0.0)
    return sum(times) + (problem.microbatches - 1) * max(times) + max(syncs), max(mems)


def _var(prob: pulp.LpProblem, name: str, upper=None, cat: str = "Continuous"):
    """A non-negative variable (pulp >= 3.3 attaches variables to the problem)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, 0, upper, cat=cat)
    return pulp.LpVariable(name, 0, upper, cat=cat)


def _stage_time(problem: StageProblem, n, s: int):
    p, c = problem.pp, problem.p2p_s
    fixed = (problem.embed.time_s if s == 0 else 0) + (problem.head.time_s if s == p - 1 else 0)
    fixed += c * (s > 0) + c * (s < p - 1)
    return pulp.lpSum(n[s, k] * o.time_s for k, o in enumerate(problem.options)) + fixed


def _ends(problem: StageProblem, s: int) -> list[EndLayer]:
    return ([problem.embed] if s == 0 else []) + ([problem.head] if s == problem.pp - 1 else [])


def _stage_memory(problem: StageProblem, n, s: int):
    f = problem.inflight[s]
    fixed = sum(e.static_bytes + f * e.act_bytes for e in _ends(problem, s))
    return pulp.lpSum(n[s, k] * (o.static_bytes + f * o.act_bytes)
                      for k, o in enumerate(problem.options)) + fixed


def _add_cover(prob, problem: StageProblem, n) -> None:
    prob += pulp.lpSum(n.values()) == problem.blocks, "all_blocks_placed"
    for s in range(1, problem.pp - 1):
        prob += pulp.lpSum(n[s, k] for k in range(len(problem.options))) >= 1, f"nonempty_{s}"


def _add_bottleneck(prob, times):
    tau = _var(prob, "tau")
    for s, t in enumerate(times):
        prob += tau >= t, f"bottleneck_{s}"
    return tau


def _add_sync(prob, problem: StageProblem, n):
    sigma = _var(prob, "sigma")
    if problem.sync_s_per_byte == 0 and problem.sync_alpha_s == 0:
        return sigma
    for s in range(problem.pp):
        grads = pulp.lpSum(n[s, k] * o.grad_bytes for k, o in enumerate(problem.options))
        grads += sum(e.grad_bytes for e in _ends(problem, s))
        prob += sigma >= problem.sync_alpha_s + problem.sync_s_per_byte * grads, f"sync_{s}"
    return sigma


def _add_memory(prob, problem: StageProblem, mems) -> None:
    for s, mem in enumerate(mems):
        prob += mem <= problem.memory_limit, f"memory_{s}"


def _objective(times, tau, sigma, m: int):
    return pulp.lpSum(times) + (m - 1) * tau + sigma


def _run(prob: pulp.LpProblem, solver: str, time_limit_s: float) -> tuple[str, float]:
    """Solve; read pulp's sol_status (LpStatus says "Optimal" even when a time limit stopped it)."""
    if solver == "highs" and pulp.HiGHS().available():
        backend = pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    else:
        backend = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)
    with _quiet():
        prob.solve(backend)
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", 0.0
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible", _gap(prob, backend)
    return "infeasible", 0.0


def _gap(prob, backend) -> float:
    model = getattr(backend, "solverModel", None) or getattr(prob, "solverModel", None)
    try:
        return float(model.getInfo().mip_gap)
    except Exception:  # noqa: BLE001 - a solver without the query reports an unknown gap
        return float("nan")


@contextlib.contextmanager
def _quiet():
    """HiGHS prints a banner from C++ even with output off: silence fd 1 around the solve."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
