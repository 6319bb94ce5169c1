"""The stage ILP over runs of different block kinds against brute force: every contiguous split of
the ordered blocks into stages and every strategy of each block's own kind."""
import itertools
import math
import random

import pytest

from planner import ilp
from runtime.generators import peak_inflight


def _splits(blocks: int, stages: int):
    """Stage sizes of every contiguous split; only the first and last stage may be empty."""
    for cuts in itertools.combinations_with_replacement(range(blocks + 1), stages - 1):
        sizes = [b - a for a, b in zip((0,) + cuts, cuts + (blocks,))]
        if all(size >= 1 for size in sizes[1:-1]):
            yield sizes


def brute_force(problem: ilp.StageProblem) -> float:
    """Places each block (in model order, of its run's kind) on a stage with one of its kind's
    options; prices the per-stage option counts with ilp.evaluate."""
    kinds = [ks for run, ks in zip(problem.block_runs(), problem.run_options())
             for _ in range(run.count)]
    best = math.inf
    for sizes in _splits(problem.blocks, problem.stages):
        for choice in itertools.product(*kinds):
            counts, pos = [], 0
            for size in sizes:
                here = choice[pos:pos + size]
                counts.append(tuple(here.count(k) for k in range(len(problem.options))))
                pos += size
            time_s, peak = ilp.evaluate(problem, counts)
            if peak <= problem.memory_limit:
                best = min(best, time_s)
    return best


def _option(rng, name):
    return ilp.BlockOption(name, rng.uniform(0.5, 4), rng.uniform(1, 4), rng.uniform(0.1, 1),
                           rng.uniform(0.5, 2))


def random_runs_problem(rng: random.Random) -> ilp.StageProblem:
    p, v = rng.randint(1, 3), rng.choice([1, 1, 2])
    name = rng.choice(["1f1b", "gpipe", "zb-h1"]) if v == 1 else "interleaved-1f1b"
    m = p * rng.randint(1, 3)
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
    end = lambda: ilp.EndLayer(rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, .5),  # noqa
                               rng.uniform(0, 1))
    alpha, beta = ilp.schedule_weights(name, p, m, v)
    phi = tuple(f / v for f in peak_inflight(name, p, m, v))
    return ilp.StageProblem(0, (), end(), end(), p, p * v, alpha, beta, rng.uniform(0, .5),
                            rng.uniform(4, 20), rng.choice([0.0, 0.3]), rng.uniform(0, .2), phi,
                            needs_tp=rng.random() < 0.3, tie_s=rng.choice([0.0, 0.4]),
                            runs=tuple(runs))


@pytest.mark.parametrize("seed", range(60))
def test_runs_ilp_matches_brute_force(seed):
    problem = random_runs_problem(random.Random(seed))
    expected = brute_force(problem)
    solution = ilp.solve(problem)
    if math.isinf(expected):
        assert solution.status == "infeasible"
        return
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(expected, rel=1e-6)
    assert ilp.evaluate(problem, solution.counts)[0] == pytest.approx(expected, rel=1e-6)
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
