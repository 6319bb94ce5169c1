"""The stage ILP against brute-force enumeration of the same space under the same costs."""
import dataclasses
import itertools
import math
import random

import pytest

from planner.search import ilp
from runtime.pipeline.generators import peak_inflight


def _compositions(total: int, parts: int, minimum: list[int]):
    """All ways to write total = sum of parts with part i >= minimum[i]."""
    if parts == 1:
        if total >= minimum[0]:
            yield (total,)
        return
    for first in range(minimum[0], total - sum(minimum[1:]) + 1):
        for rest in _compositions(total - first, parts - 1, minimum[1:]):
            yield (first,) + rest


def _assignments(problem: ilp.StageProblem, kinds=None):
    """Every contiguous stage split and every per-block strategy, as per-stage counts. `kinds`:
    the option indices each block may take, in model order (test_ilp_runs); default any."""
    S, k = problem.stages, len(problem.options)
    kinds = kinds or [range(k)] * problem.blocks
    minimum = [0 if s in (0, S - 1) else 1 for s in range(S)]
    for sizes in _compositions(problem.blocks, S, minimum):
        if S > problem.ranks and not _even_chunks(sizes, problem.blocks):
            continue
        for choice in itertools.product(*kinds):
            counts, pos = [], 0
            for size in sizes:
                counts.append(tuple(choice[pos:pos + size].count(j) for j in range(k)))
                pos += size
            yield counts


def _even_chunks(sizes, blocks: int) -> bool:
    """Interleaved stages hold floor or ceil of blocks / stages; the two ends one fewer at most."""
    S = len(sizes)
    lo, hi = blocks // S, -(-blocks // S)
    return all(lo - (s in (0, S - 1)) <= size <= hi for s, size in enumerate(sizes))


def brute_force(problem: ilp.StageProblem, kinds=None) -> float:
    """The least time of the assignments that fit, priced with ilp.evaluate."""
    best = math.inf
    for counts in _assignments(problem, kinds):
        time_s, peak = ilp.evaluate(problem, counts)
        if peak <= problem.memory_limit:
            best = min(best, time_s)
    return best


def assert_matches_brute_force(problem: ilp.StageProblem, kinds=None) -> ilp.Solution:
    """ilp.solve finds the brute-force optimum (or says infeasible where nothing fits)."""
    expected = brute_force(problem, kinds)
    solution = ilp.solve(problem)
    if math.isinf(expected):
        assert solution.status == "infeasible"
        return solution
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(expected, rel=1e-6)
    assert ilp.evaluate(problem, solution.counts)[0] == pytest.approx(expected, rel=1e-6)
    return solution


def random_pipeline(rng: random.Random) -> tuple[int, int, str, int]:
    """(ranks p, stages per rank v, schedule, micro-batches m)."""
    p, v = rng.randint(1, 3), rng.choice([1, 1, 2])
    name = rng.choice(["1f1b", "gpipe", "zb-h1"]) if v == 1 else "interleaved-1f1b"
    return p, v, name, p * rng.randint(1, 3)


def problem_with_random_costs(rng: random.Random, pipeline, blocks: int, options, ties, runs=()):
    """The problem of `blocks` x `options` (or `runs`) on `pipeline` with random end layers,
    memory and communication."""
    p, v, name, m = pipeline
    end = lambda: ilp.EndLayer(rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, .5),  # noqa
                               rng.uniform(0, 1))
    alpha, beta = ilp.schedule_weights(name, p, m, v)
    phi = tuple(f / v for f in peak_inflight(name, p, m, v))
    return ilp.StageProblem(blocks, options, end(), end(), p, p * v, alpha, beta,
                            rng.uniform(0, .5), rng.uniform(4, 20), rng.choice([0.0, 0.3]),
                            rng.uniform(0, .2), phi, needs_tp=rng.random() < 0.3,
                            tie_s=rng.choice(ties), runs=runs)


def random_problem(rng: random.Random) -> ilp.StageProblem:
    pipeline = random_pipeline(rng)
    p, v = pipeline[:2]
    blocks = rng.randint(max(1, p * v - 2), 6)
    options = tuple(ilp.BlockOption(rng.choice(["none", "tp", "tp+sel"]), rng.uniform(1, 3), rng.uniform(1, 4),
                                    rng.uniform(0.1, 1), rng.uniform(0.5, 2))
                    for j in range(rng.randint(1, 3)))
    return problem_with_random_costs(rng, pipeline, blocks, options, ties=[0.0, 0.0, 0.4])


def _solved(seed: int) -> tuple[ilp.StageProblem, ilp.Solution]:
    problem = random_problem(random.Random(seed))
    return problem, ilp.solve(problem)


@pytest.mark.parametrize("seed", range(80))
def test_ilp_matches_brute_force(seed):
    assert_matches_brute_force(random_problem(random.Random(seed)))


@pytest.mark.parametrize("seed", range(40))
def test_ilp_with_the_runtimes_own_terms_matches_brute_force(seed):
    """q (seconds per stage and micro-batch) and o_k (each block's optimizer step, in σ's rows)
    of a calibrated CPU cluster, on the same random problems."""
    rng = random.Random(1000 + seed)
    problem = random_problem(random.Random(seed))
    options = tuple(dataclasses.replace(o, step_s=rng.uniform(0, 0.5)) for o in problem.options)
    embed, head = (dataclasses.replace(e, step_s=rng.uniform(0, 0.5))
                   for e in (problem.embed, problem.head))
    assert_matches_brute_force(dataclasses.replace(problem, options=options, embed=embed,
                                                   head=head, stage_s=rng.uniform(0, 0.4)))


def test_memory_objective_finds_the_smallest_peak():
    problem = random_problem(random.Random(7))
    solution = ilp.solve(problem, objective="memory")
    peaks = [ilp.evaluate(problem, counts)[1] for counts in _assignments(problem)]
    assert solution.objective == pytest.approx(min(peaks), rel=1e-6)


def test_too_few_blocks_for_the_stages_is_infeasible():
    problem = random_problem(random.Random(3))
    problem = ilp.StageProblem(**{**problem.__dict__, "blocks": 1, "ranks": 4, "stages": 4,
                                  "act_factor": (4, 3, 2, 1)})
    assert ilp.solve(problem).status == "infeasible"


def hard_problem() -> ilp.StageProblem:
    """200 blocks on a 32-rank 1F1B pipeline with four strategies and memory that forces each
    rank into its own mix: HiGHS finds plans at once but needs well over 15 s to prove one
    optimal (the gap was still 1.5% after 15 s when this was written)."""
    rng = random.Random(2)
    options = tuple(ilp.BlockOption(name, rng.uniform(1, 1.6), rng.uniform(1, 3),
                                    rng.uniform(0.2, 1.0), rng.uniform(0.5, 2))
                    for name in ("tp", "tp+sel", "tp+full", "tp+sp"))
    p, m, blocks = 32, 48, 200
    embed = ilp.EndLayer(rng.uniform(0.5, 3), 2.0, 0.5, 1.0)
    head = ilp.EndLayer(rng.uniform(0.5, 3), 2.0, 0.5, 1.0)
    memory = blocks / p * 2.0 + 0.3 * blocks
    return ilp.StageProblem(blocks, options, embed, head, p, p, *ilp.schedule_weights("1f1b", p, m),
                            0.01, memory, 0.01, 1e-3, tuple(peak_inflight("1f1b", p, m)))


def test_a_time_limit_returns_the_best_assignment_found_with_its_gap():
    problem = hard_problem()
    stopped = ilp.solve(problem, time_limit_s=1.0)
    assert stopped.status == "feasible", "the time limit stopped HiGHS: not proven optimal"
    assert 0 < stopped.gap < 1
    # The assignment is a real one: evaluated on its own it has the reported time and fits.
    time_s, peak = ilp.evaluate(problem, stopped.counts)
    assert time_s == pytest.approx(stopped.objective, rel=1e-6)
    assert peak <= problem.memory_limit * (1 + 1e-9)
    assert sum(map(sum, stopped.counts)) == problem.blocks


@pytest.mark.parametrize("seed", range(40))
def test_a_cutoff_keeps_exactly_the_solutions_below_it(seed):
    problem, best = _solved(seed)
    if best.status == "infeasible":
        return
    above = ilp.solve(problem, cutoff=best.objective * 1.001)
    assert above.status == "optimal"
    assert above.objective == pytest.approx(best.objective, rel=1e-6)
    assert ilp.solve(problem, cutoff=best.objective * 0.999).status == "cutoff"


@pytest.mark.parametrize("seed", range(80))
def test_busiest_rank_floor_is_a_lower_bound(seed):
    """ρ* never exceeds the slowest rank of the optimal assignment (so it prunes nothing)."""
    problem, best = _solved(seed)
    if best.status == "infeasible":
        return
    assert ilp.rank_floor(problem) <= max(ilp.breakdown(problem, best.counts).rank_s) + 1e-9


def test_busiest_rank_floor_sees_whole_blocks():
    # 96 blocks on 64 ranks: some rank holds 2 (not 1.5); with a 0.5 s embedding on the first
    # rank and 0.1 s boundaries, a middle rank holding 2 blocks (2.2 s) is the best possible.
    assert ilp.busiest_rank_floor(96, 64, 64, 1.0, 0.5, 0.5, 0.1) == pytest.approx(2.2)
    # 96 on 32: 3 each, but the first rank pays 1.0 s of fixed time, so it holds 2 and a middle
    # rank must hold 4 (4.2 s), or the first holds 3 (4.0 s): 4.0.
    assert ilp.busiest_rank_floor(96, 32, 32, 1.0, 0.9, 0.2, 0.1) == pytest.approx(4.0)
    assert ilp.busiest_rank_floor(5, 1, 1, 1.0, 0.3, 0.2, 0.1) == pytest.approx(5.5)


def _scanned_rank_floor(blocks, ranks, stages, t, embed_s, head_s, p2p_s, stage_s):
    """ρ* of busiest_rank_floor's definition, by scanning j = 0, 1, 2, ... for each kind of rank."""
    v = stages // ranks
    fixed = [2 * p2p_s * v - p2p_s * ((r == 0) + (r == ranks - 1)) + embed_s * (r == 0)
             + head_s * (r == ranks - 1) + stage_s * v for r in range(ranks)]
    start = max(fixed)
    def holds(rho):
        return sum(math.floor((rho - f) / t + 1e-9) for f in fixed if rho >= f)
    best = math.inf
    for f in {fixed[0], fixed[-1], fixed[min(1, ranks - 1)]}:
        j = max(0, math.ceil((start - f) / t - 1e-9))
        stop = j + blocks
        while j < stop and holds(f + j * t) < blocks:
            j += 1
        best = min(best, f + j * t)
    return max(start, best) * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_busiest_rank_floor_is_the_least_rho_that_holds_every_block(seed):
    """Searched out from an even spread of the blocks, ρ* is what scanning finds, to the bit."""
    rng = random.Random(seed)
    for _ in range(50):
        ranks = rng.choice([1, 2, 3, 5, 8, 16])
        args = (rng.choice([1, 3, 24, 61, 96]), ranks, ranks * rng.choice([1, 2, 3]),
                rng.uniform(1e-3, 1.0), rng.choice([0.0, rng.uniform(0, 0.5)]),
                rng.uniform(0, 0.5), rng.choice([0.0, rng.uniform(0, 0.05)]),
                rng.choice([0.0, rng.uniform(0, 0.01)]))
        assert ilp.busiest_rank_floor(*args) == _scanned_rank_floor(*args)


@pytest.mark.parametrize("seed", range(40))
def test_polish_keeps_the_time_and_takes_the_least_total_stage_time(seed):
    """Among every assignment as fast as the optimum (brute force), polish finds the one with
    the least Σ_s T_s, so stages off the critical rank use their fastest strategy."""
    problem, solution = _solved(seed)
    if solution.status != "optimal":
        return
    polished = ilp.polish(problem, solution)
    best = solution.objective * (1 + 1e-9) + 1e-12
    least = min(sum(ilp.breakdown(problem, c).stage_s) for c in _assignments(problem)
                if ilp.evaluate(problem, c)[0] <= best
                and ilp.evaluate(problem, c)[1] <= problem.memory_limit)
    assert polished.objective <= best
    assert ilp.evaluate(problem, polished.counts)[1] <= problem.memory_limit * (1 + 1e-9)
    assert sum(ilp.breakdown(problem, polished.counts).stage_s) == pytest.approx(least, rel=1e-6)


@pytest.mark.parametrize("seed", range(40))
def test_ilp_with_collectives_beside_compute_matches_brute_force(seed):
    """The data-parallel collectives a GPU runs beside compute (a', b', κ, λ: σ's second pair of
    rows) on the same random problems: exposed max(λ·H, H − κ·ΣT) as ilp.evaluate prices it."""
    rng = random.Random(2000 + seed)
    problem = random_problem(random.Random(seed))
    assert_matches_brute_force(dataclasses.replace(
        problem, hide_alpha_s=rng.uniform(0, 2), hide_s_per_byte=rng.uniform(0, 1.5),
        hide_beside=rng.uniform(0, 3), hide_least=rng.uniform(0.05, 0.5)))


def test_collectives_beside_compute_are_exposed_only_past_it():
    problem = random_problem(random.Random(0))
    hidden = dataclasses.replace(problem, sync_alpha_s=0.0, sync_s_per_byte=0.0, tie_s=0.0,
                                 hide_alpha_s=1.0, hide_beside=1.0, hide_least=0.1)
    assert ilp._sync_time(hidden, 0.0, rank_s=5.0) == pytest.approx(0.1)   # λ·H: hidden
    assert ilp._sync_time(hidden, 0.0, rank_s=0.5) == pytest.approx(0.5)   # H − κ·ΣT

