"""The outer search: every mesh (dp, tp, pp) and micro-batching, each solved by the stage ILP.

Configurations are visited in order of a lower bound on their iteration time (perfectly balanced
stages, cheapest strategy everywhere) and skipped once the bound cannot beat the k-th best plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cost_model.cluster import Cluster
from cost_model.comm import collective_time
from cost_model.layer_cost import LayerCost, price, profile_layer
from cost_model.strategy import Strategy, strategy_space
from passes.capture import Captured
from passes.tensor_parallel import ShardingError
from planner import ilp
from planner.plan import Plan, Predicted, StagePlan


class PlanningError(ValueError):
    """No plan satisfies the request; the message says what would."""


@dataclass(frozen=True)
class Request:
    gpus: int
    cluster: Cluster
    global_batch: int
    seq: int
    memory_limit: float
    model_name: str = "model"
    fix: dict = field(default_factory=dict)
    schedule: str = "1f1b"
    top_k: int = 5
    runnable_only: bool = True
    time_limit_s: float = 30.0


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int
    lower_bound: float


class ModelCosts:
    """Layer profiles of one captured model, with its block count, priced on demand."""

    def __init__(self, captured: Captured, num_blocks: int, dtype_bytes: int):
        signatures = {b.signature for b in captured.blocks}
        if len(signatures) > 1:
            raise PlanningError("the model's repeated blocks differ in structure or shape; "
                                "fxpar plans chains of identical blocks")
        self.captured = captured
        self.num_blocks = num_blocks
        self.dtype_bytes = dtype_bytes
        self.block = captured.blocks[0]
        self.ends = {l.kind: profile_layer(captured, l) for l in captured.layers if l.kind != "block"}
        self._profiles = {1: profile_layer(captured, self.block)}
        self.tp_errors: dict[int, str] = {}

    def block_profile(self, tp: int):
        if tp not in self._profiles and tp not in self.tp_errors:
            try:
                self._profiles[tp] = profile_layer(self.captured, self.block, tp)
            except ShardingError as err:
                self.tp_errors[tp] = str(err)
        return self._profiles.get(tp)

    def static_bytes(self, params: int) -> tuple[float, float]:
        """(weights + gradients, optimizer states): mixed-precision Adam keeps fp32 master weights
        and two fp32 moments for 16-bit models; plain Adam keeps two moments."""
        opt = 12 if self.dtype_bytes < 4 else 8
        return 2.0 * self.dtype_bytes * params, float(opt * params)


def tp_sizes(costs: ModelCosts, gpus: int, cluster: Cluster) -> list[int]:
    sizes = [t for t in _divisors(gpus) if cluster.device == "cpu" or t <= cluster.gpus_per_node]
    return [t for t in sizes if t == 1 or costs.block_profile(t) is not None]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(costs: ModelCosts, req: Request) -> list[Candidate]:
    result = []
    fix = req.fix
    for tp in tp_sizes(costs, req.gpus, req.cluster):
        for pp in _divisors(req.gpus // tp):
            dp = req.gpus // (tp * pp)
            if any(k in fix and fix[k] != v for k, v in (("tp", tp), ("pp", pp), ("dp", dp))):
                continue
            if pp > costs.num_blocks + 2 or req.global_batch % dp:
                continue
            for b in _divisors(req.global_batch // dp):
                if "mb" in fix and fix["mb"] != b:
                    continue
                m = req.global_batch // (dp * b)
                result.append(Candidate(dp, tp, pp, b, m, _lower_bound(costs, req, tp, pp, b, m)))
    return sorted(result, key=lambda c: (c.lower_bound, c.pp, c.tp))


def _block_costs(costs: ModelCosts, req: Request, tp: int, b: int) -> list[LayerCost]:
    out = []
    space = strategy_space(tp, req.runnable_only)
    if "strategy" in req.fix:  # a user-fixed strategy for every block (e.g. Megatron's "tp")
        space = [Strategy.parse(req.fix["strategy"])]
        if space[0].tp and tp == 1:
            space = [Strategy(False, False, space[0].recompute)]
    for strategy in space:
        profile = costs.block_profile(tp if strategy.tp else 1)
        out.append(price(profile, strategy, b, req.cluster, tp))
    return out


def _end_cost(costs: ModelCosts, req: Request, kind: str, b: int) -> LayerCost | None:
    profile = costs.ends.get(kind)
    return price(profile, Strategy(), b, req.cluster) if profile else None


def _lower_bound(costs, req, tp, pp, b, m) -> float:
    cheapest = min(c.fwd_s + c.bwd_s for c in _block_costs(costs, req, tp, b))
    ends = sum(c.fwd_s + c.bwd_s for c in (_end_cost(costs, req, k, b) for k in ("embed", "head"))
               if c)
    total = costs.num_blocks * cheapest + ends
    return total + (m - 1) * total / pp


def _end_layer(costs: ModelCosts, cost: LayerCost | None) -> ilp.EndLayer:
    if cost is None:
        return ilp.EndLayer(0.0, 0.0, 0.0, 0.0)
    weights, opt = costs.static_bytes(cost.params)
    return ilp.EndLayer(cost.fwd_s + cost.bwd_s, weights + opt, cost.act_bytes,
                        cost.params * costs.dtype_bytes)


def build_problem(costs: ModelCosts, req: Request, c: Candidate, memory_limit: float):
    blocks = _block_costs(costs, req, c.tp, c.micro_batch)
    options = []
    for cost in blocks:
        weights, opt = costs.static_bytes(cost.params)
        options.append(ilp.BlockOption(str(cost.strategy), cost.fwd_s + cost.bwd_s, weights + opt,
                                       cost.act_bytes, cost.params * costs.dtype_bytes))
    boundary = costs._profiles[1].output_bytes * c.micro_batch / costs._profiles[1].batch
    p2p = 2 * collective_time(req.cluster, "p2p", boundary, 2, stride=c.tp * c.dp)
    alpha = collective_time(req.cluster, "all_reduce", 0.0, c.dp, stride=c.tp)
    slope = (collective_time(req.cluster, "all_reduce", 2.0**30, c.dp, stride=c.tp) - alpha) / 2**30
    exposed = 1.0 - req.cluster.dp_overlap
    problem = ilp.StageProblem(
        costs.num_blocks, tuple(options), _end_layer(costs, _end_cost(costs, req, "embed", c.micro_batch)),
        _end_layer(costs, _end_cost(costs, req, "head", c.micro_batch)), c.pp, c.microbatches,
        p2p if c.pp > 1 else 0.0, memory_limit, alpha * exposed, slope * exposed,
        tuple(min(c.pp - s, c.microbatches) for s in range(c.pp)))
    return problem, blocks


def search(costs: ModelCosts, req: Request) -> list[Plan]:
    """The best plans, fastest first (at most req.top_k)."""
    found: list[Plan] = []
    for cand in candidates(costs, req):
        if len(found) >= req.top_k and cand.lower_bound >= found[-1].predicted.iteration_s:
            break
        problem, blocks = build_problem(costs, req, cand, req.memory_limit)
        solution = ilp.solve(problem, time_limit_s=req.time_limit_s)
        if solution.status == "infeasible":
            continue
        found.append(make_plan(costs, req, cand, problem, blocks, solution))
        found.sort(key=lambda p: p.predicted.iteration_s)
        del found[req.top_k:]
    return found


def smallest_memory(costs: ModelCosts, req: Request) -> tuple[float, Candidate | None]:
    """The least peak memory per device any candidate needs (for infeasibility errors)."""
    best, where = math.inf, None
    for cand in candidates(costs, req):
        problem, _ = build_problem(costs, req, cand, math.inf)
        sol = ilp.solve(problem, objective="memory", time_limit_s=req.time_limit_s)
        if sol.status != "infeasible" and sol.objective < best:
            best, where = sol.objective, cand
    return best, where


def make_plan(costs, req, cand, problem, blocks, solution) -> Plan:
    stages, block_index = [], 0
    for s, counts in enumerate(solution.counts):
        names, strategies = (["embed"] if s == 0 and "embed" in costs.ends else []), []
        strategies += ["none"] * len(names)
        for k, count in enumerate(counts):
            names += [f"{costs.block.name.rsplit('.', 1)[0]}.{block_index + i}" for i in range(count)]
            strategies += [problem.options[k].name] * count
            block_index += count
        if s == cand.pp - 1 and "head" in costs.ends:
            names.append("head")
            strategies.append("none")
        stages.append(_stage_plan(costs, problem, blocks, s, counts, tuple(names), tuple(strategies)))
    return Plan(req.model_name, req.gpus, req.cluster.name, cand.dp, cand.tp, cand.pp,
                cand.micro_batch, cand.microbatches, req.global_batch, req.seq, req.schedule,
                req.memory_limit, tuple(stages), _predict(costs, req, cand, problem, blocks, stages),
                _notes(costs), f"{solution.status}, gap {solution.gap:.2%}, {solution.seconds:.2f} s")


def _stage_plan(costs, problem, blocks, s, counts, names, strategies) -> StagePlan:
    f = problem.inflight[s]
    ends = ilp._ends(problem, s)
    time_s = sum(c * o.time_s for c, o in zip(counts, problem.options)) + sum(e.time_s for e in ends)
    params = sum(c * b.params for c, b in zip(counts, blocks))
    params += sum(e.grad_bytes / costs.dtype_bytes for e in ends)
    weights, opt = costs.static_bytes(int(params))
    act = f * (sum(c * o.act_bytes for c, o in zip(counts, problem.options))
               + sum(e.act_bytes for e in ends))
    return StagePlan(names, strategies, time_s, weights, opt, act)


def _predict(costs, req, cand, problem, blocks, stages) -> Predicted:
    m, p = cand.microbatches, cand.pp
    times = [st.time_s + problem.p2p_s * ((s > 0) + (s < p - 1)) for s, st in enumerate(stages)]
    tau = max(times)
    sync = max(problem.sync_alpha_s + problem.sync_s_per_byte * costs.dtype_bytes *
               (st.param_bytes / (2 * costs.dtype_bytes)) for st in stages) if cand.dp > 1 else 0.0
    iteration = sum(times) + (m - 1) * tau + sync
    bottleneck = stages[times.index(tau)]
    comm_per_mb = sum(b.comm_s for b, name in zip(blocks, [str(b.strategy) for b in blocks])
                      for _ in range(bottleneck.strategies.count(name)))
    comm_per_mb += problem.p2p_s * ((p > 1) + (p > 2))
    bubble = max(iteration - m * tau - sync, 0.0)  # rounding can leave -1e-19
    model_flops = req.global_batch * _flops_per_sample(costs)
    return Predicted(iteration, m * (tau - comm_per_mb), m * comm_per_mb + sync, bubble,
                     bubble / (m * tau), max(st.memory_bytes for st in stages),
                     req.global_batch * req.seq / iteration,
                     model_flops / iteration / req.gpus / 1e12)


def _flops_per_sample(costs: ModelCosts) -> float:
    one = costs._profiles[1]
    per = price(one, Strategy(), one.batch, _FLOP_ONLY).model_flops / one.batch
    ends = sum(price(p, Strategy(), p.batch, _FLOP_ONLY).model_flops / p.batch
               for p in costs.ends.values())
    return costs.num_blocks * per + ends


def _notes(costs: ModelCosts) -> tuple[str, ...]:
    if costs.tp_errors and not any(t > 1 for t in costs._profiles):
        first = min(costs.tp_errors)
        return (f"planned without tensor parallelism: no tp size above 1 divides the model "
                f"({costs.tp_errors[first]})",)
    return ()


def _cluster_for_flops() -> Cluster:
    from cost_model.cluster import get_cluster
    return get_cluster("cpu-gloo")


_FLOP_ONLY = _cluster_for_flops()


def dtype_bytes(model: torch.nn.Module) -> int:
    param = next(model.parameters(), None)
    return param.element_size() if param is not None else 4
