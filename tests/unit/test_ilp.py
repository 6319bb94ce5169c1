"""The stage ILP against brute-force enumeration of the same space under the same costs."""
import itertools
import math
import random

import pytest

from planner import ilp


def _compositions(total: int, parts: int, minimum: list[int]):
    """All ways to write total = sum of parts with part i >= minimum[i]."""
    if parts == 1:
        if total >= minimum[0]:
            yield (total,)
        return
    for first in range(minimum[0], total - sum(minimum[1:]) + 1):
        for rest in _compositions(total - first, parts - 1, minimum[1:]):
            yield (first,) + rest


def brute_force(problem: ilp.StageProblem) -> float:
    """Every contiguous stage split and every per-block strategy, best feasible time."""
    p, k = problem.pp, len(problem.options)
    minimum = [0 if s in (0, p - 1) else 1 for s in range(p)]
    best = math.inf
    for sizes in _compositions(problem.blocks, p, minimum):
        for choice in itertools.product(range(k), repeat=problem.blocks):
            counts, pos = [], 0
            for size in sizes:
                counts.append(tuple(choice[pos:pos + size].count(j) for j in range(k)))
                pos += size
            time_s, peak = ilp.evaluate(problem, counts)
            if peak <= problem.memory_limit:
                best = min(best, time_s)
    return best


def random_problem(rng: random.Random) -> ilp.StageProblem:
    blocks, pp = rng.randint(1, 6), rng.randint(1, 4)
    m = rng.randint(1, 6)
    options = tuple(ilp.BlockOption(f"s{j}", rng.uniform(1, 3), rng.uniform(1, 4),
                                    rng.uniform(0.1, 1), rng.uniform(0.5, 2))
                    for j in range(rng.randint(1, 3)))
    end = lambda: ilp.EndLayer(rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, .5),  # noqa
                               rng.uniform(0, 1))
    return ilp.StageProblem(blocks, options, end(), end(), pp, m, rng.uniform(0, .5),
                            rng.uniform(4, 20), rng.choice([0.0, 0.3]), rng.uniform(0, .2),
                            tuple(min(pp - s, m) for s in range(pp)))


@pytest.mark.parametrize("seed", range(60))
def test_ilp_matches_brute_force(seed):
    problem = random_problem(random.Random(seed))
    expected = brute_force(problem)
    solution = ilp.solve(problem)
    if math.isinf(expected):
        assert solution.status == "infeasible"
        return
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(expected, rel=1e-6)
    assert ilp.evaluate(problem, solution.counts)[0] == pytest.approx(expected, rel=1e-6)


def test_memory_objective_finds_the_smallest_peak():
    problem = random_problem(random.Random(7))
    solution = ilp.solve(problem, objective="memory")
    peaks = []
    p, k = problem.pp, len(problem.options)
    for sizes in _compositions(problem.blocks, p, [0 if s in (0, p - 1) else 1 for s in range(p)]):
        for choice in itertools.product(range(k), repeat=problem.blocks):
            counts, pos = [], 0
            for size in sizes:
                counts.append(tuple(choice[pos:pos + size].count(j) for j in range(k)))
                pos += size
            peaks.append(ilp.evaluate(problem, counts)[1])
    assert solution.objective == pytest.approx(min(peaks), rel=1e-6)


def test_too_few_blocks_for_the_stages_is_infeasible():
    problem = random_problem(random.Random(3))
    problem = ilp.StageProblem(**{**problem.__dict__, "blocks": 1, "pp": 4,
                                  "inflight": (4, 3, 2, 1)})
    assert ilp.solve(problem).status == "infeasible"
