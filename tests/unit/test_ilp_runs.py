"""The stage ILP over runs of different block kinds against brute force: every contiguous split of
the ordered blocks into stages and every strategy of each block's own kind."""
import random

import pytest

from planner.search import ilp
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
