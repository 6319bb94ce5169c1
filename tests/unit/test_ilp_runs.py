"""The stage ILP over runs of different block kinds against brute force: every contiguous split of
the ordered blocks into stages and every strategy of each block's own kind."""
import random
from dataclasses import replace

import pytest

from planner.search import contiguity, ilp
from test_ilp import assert_matches_brute_force, problem_with_random_costs, random_pipeline


def block_kinds(problem: ilp.StageProblem) -> list[range]:
    """The option indices each block may take (its run's kind's), in model order."""
    return [ks for run, ks in zip(problem.block_runs(), problem.run_options())
            for _ in range(run.count)]


def _option(rng, name):
    return ilp.BlockOption(name, rng.uniform(0.5, 4), rng.uniform(1, 4), rng.uniform(0.1, 1),
                           rng.uniform(0.5, 2))


def random_runs_problem(rng: random.Random) -> ilp.StageProblem:
    pipeline = random_pipeline(rng)
    p, v = pipeline[:2]
    kinds = {}
    for kind in ("dense", "moe", "wide")[:rng.randint(2, 3)]:
        names = rng.sample(["none", "tp", "tp+sel"], rng.randint(1, 2))
        kinds[kind] = tuple(_option(rng, n) for n in names)
    runs, total = [], rng.randint(max(2, p * v - 2), 6)
    while total:
        count = rng.randint(1, total)
        kind = rng.choice([k for k in kinds if not runs or k != runs[-1].kind])
        runs.append(ilp.BlockRun(kind, count, kinds[kind]))
        total -= count
    return problem_with_random_costs(rng, pipeline, 0, (), ties=[0.0, 0.4], runs=tuple(runs))


@pytest.mark.parametrize("seed", range(60))
def test_runs_ilp_matches_brute_force(seed):
    problem = random_runs_problem(random.Random(seed))
    solution = assert_matches_brute_force(problem, block_kinds(problem))
    if solution.status == "optimal":
        _assert_contiguous(problem, solution.counts)


def _assert_contiguous(problem, counts):
    """Per run, the stages' counts read in stage order fill the runs in model order."""
    ranges = problem.run_options()
    sequence = [j for row in counts for j, ks in enumerate(ranges) for _ in range(sum(row[k] for k in ks))]
    assert sequence == sorted(sequence)


@pytest.mark.parametrize("seed", range(20))
def test_runs_relaxation_bounds_the_optimum(seed):
    problem = random_runs_problem(random.Random(100 + seed))
    solution, relaxed = ilp.solve(problem), ilp.solve(problem, relax=True)
    if solution.status == "optimal":
        assert relaxed.objective <= solution.objective * (1 + 1e-7)


def test_one_run_is_the_homogeneous_problem():
    rng = random.Random(7)
    options = (_option(rng, "none"), _option(rng, "tp"))
    base = ilp.StageProblem(6, options, ilp.EndLayer(1, 1, .1, .1), ilp.EndLayer(1, 1, .1, .1), 2,
                            2, 1.0, 3.0, 0.1, 100.0, 0.0, 0.0, (2.0, 1.0))
    runs = ilp.StageProblem(0, (), base.embed, base.head, 2, 2, 1.0, 3.0, 0.1, 100.0, 0.0, 0.0,
                            (2.0, 1.0), runs=(ilp.BlockRun("block", 6, options),))
    assert (runs.blocks, runs.options) == (base.blocks, base.options)
    assert ilp.solve(runs).objective == pytest.approx(ilp.solve(base).objective, rel=1e-9)


def test_a_run_needs_blocks_and_options():
    with pytest.raises(ValueError, match="count >= 1"):
        ilp.BlockRun("dense", 0, (ilp.BlockOption("none", 1, 1, 1, 1),))


@pytest.mark.parametrize("seed", range(12))
def test_pooled_runs_plan_as_runs_do(seed):
    """Runs that repeat a kind are solved pooled by kind (planner.search.contiguity): beyond
    brute force's reach (12-20 blocks in a repeating pattern), the same optimum as the by-run
    form (the same runs under names of their own, which nothing pools), given back per run:
    contiguous, every block one of its own kind's options."""
    rng = random.Random(300 + seed)
    kinds = {k: tuple(_option(rng, n) for n in ("none", "tp", "tp+sel")[:rng.randint(1, 3)])
             for k in ("dense", "moe")}
    pattern = rng.choice([("dense", "moe"), ("dense", "moe", "moe"), ("dense", "dense", "moe")])
    kinds_in_order = [pattern[i % len(pattern)] for i in range(rng.randint(12, 20))]
    runs = tuple(ilp.BlockRun(k, 1, kinds[k]) for k in kinds_in_order)
    pipeline = (rng.choice([2, 3, 4]), 1, rng.choice(["1f1b", "gpipe"]), 8)
    pooled = problem_with_random_costs(rng, pipeline, 0, (), ties=[0.0], runs=runs)
    whole = sum(max(o.static_bytes + o.act_bytes * max(pooled.act_factor) for o in r.options)
                for r in runs)   # a limit that binds on some plans and not on all
    pooled = replace(pooled, memory_limit=whole * rng.uniform(0.4, 0.8))
    by_run = replace(pooled, runs=tuple(replace(r, kind=f"{r.kind}{i}") for i, r in
                                        enumerate(runs)))
    assert contiguity.pooled(pooled) is not None and contiguity.pooled(by_run) is None
    a, b = ilp.solve(pooled), ilp.solve(by_run)
    assert a.status == b.status and a.status in ("optimal", "infeasible")
    if a.status == "optimal":
        assert a.objective == pytest.approx(b.objective, rel=1e-7)
        assert ilp.breakdown(pooled, a.counts).iteration_s == pytest.approx(a.objective,
                                                                            rel=1e-7)
        _assert_contiguous(pooled, a.counts)
        for row in a.counts:   # a run of one block holds it under exactly one option
            for ks in pooled.run_options():
                assert sum(row[k] for k in ks) <= 1
