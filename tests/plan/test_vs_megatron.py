"""The planner never loses to the best uniform Megatron-style configuration (one tp, pp, dp and
micro-batch size for the whole model, every block the same strategy, blocks split evenly, 1F1B),
found by enumerating all of them under the same cost model."""
import math

import pytest

from cost_model.hardware.cluster import get_cluster
from planner.search import ilp
from planner.api import _model_costs
from planner.models.presets import PRESETS
from planner.search.meshes import Candidate, Request, search, tp_sizes
from planner.search.problem import build_problem


def _even(blocks: int, stages: int) -> list[int]:
    return [blocks // stages + (1 if s < blocks % stages else 0) for s in range(stages)]


def best_uniform(costs, req: Request) -> float:
    best = math.inf
    for tp in tp_sizes(costs, req.gpus, req.cluster):
        for pp in (d for d in range(1, req.gpus // tp + 1) if (req.gpus // tp) % d == 0):
            dp = req.gpus // (tp * pp)
            if req.global_batch % dp or pp > costs.num_blocks:
                continue
            for b in (d for d in range(1, req.global_batch // dp + 1)
                      if (req.global_batch // dp) % d == 0):
                m = req.global_batch // (dp * b)
                cand = Candidate(dp, tp, pp, b, m, "1f1b", 1, 0.0)
                problem, _ = build_problem(costs, req, cand, req.memory_limit)
                for counts in _uniform_counts(problem, pp):
                    time_s, peak = ilp.evaluate(problem, counts)
                    # the tensors' share of the device, as the search holds it to
                    if peak <= problem.memory_limit:
                        best = min(best, time_s)
    return best


def _uniform_counts(problem: ilp.StageProblem, pp: int):
    """Per-stage option counts of every block under one strategy, blocks split evenly; with runs
    of blocks of several kinds, each block takes its own run's option of that strategy (a
    strategy some run does not offer, being dominated there, is skipped)."""
    runs, ranges = problem.block_runs(), problem.run_options()
    names = set.intersection(*({problem.options[k].name for k in ks} for ks in ranges))
    for name in sorted(names):
        per_block = [next(k for k in ks if problem.options[k].name == name)
                     for run, ks in zip(runs, ranges) for _ in range(run.count)]
        counts, first = [], 0
        for size in _even(problem.blocks, pp):
            here = per_block[first:first + size]
            counts.append(tuple(here.count(k) for k in range(len(problem.options))))
            first += size
        yield counts


CASES = [(name, gpus) for name in sorted(PRESETS) for gpus in (8, 64, 1024)]


@pytest.mark.parametrize("name,gpus", CASES)
def test_planner_beats_or_ties_uniform_megatron(name, gpus):
    cluster = get_cluster("a100-80g-dgx")
    costs, model, batch, seq = _model_costs(name, None, None, None)
    req = Request(gpus, cluster, max(batch, gpus), seq, cluster.mem_bytes, model, top_k=1)
    uniform = best_uniform(costs, req)
    plans = search(costs, req)
    if math.isinf(uniform):
        return  # no uniform configuration fits in memory: nothing to compare against
    assert plans, f"the planner found nothing where a uniform plan fits ({uniform:.4g} s)"
    assert plans[0].predicted.iteration_s <= uniform * (1 + 1e-9)
