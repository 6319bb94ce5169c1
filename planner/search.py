"""The outer search: every mesh (dp, tp, pp), micro-batching and schedule, each solved by the
stage ILP (planner.ilp).

Configurations are visited in order of a lower bound on their iteration time (perfectly balanced
stages, the cheapest strategy everywhere, no communication) and the search stops once the bound
cannot beat the k-th best plan found — exact for the best plan, since every skipped configuration
is provably slower. Strategies that another strategy beats on time, memory and gradient bytes at
once are pruned before the ILP sees them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from cost_model.cluster import Cluster
from cost_model.comm import collective_time
from cost_model.layer_cost import LayerCost, price
from cost_model.strategy import Strategy, strategy_space
from planner import ilp
from planner.costs import ModelCosts, PlanningError  # noqa: F401 - re-exported
from planner.plan import Plan, Predicted, StagePlan
from runtime.generators import peak_inflight

# (schedule, v) pairs the search tries; GPipe has 1F1B's time and more memory, so only a fix picks it.
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
FIX_KEYS = ("dp", "tp", "pp", "cp", "mb", "v", "schedule", "strategy", "recompute")


@dataclass(frozen=True)
class Request:
    gpus: int
    cluster: Cluster
    global_batch: int
    seq: int
    memory_limit: float
    model_name: str = "model"
    fix: dict = field(default_factory=dict)
    top_k: int = 5
    runnable_only: bool = True
    time_limit_s: float = 1.0      # per ILP: a stopped search reports its plan with the gap
    schedules: tuple[tuple[str, int], ...] = SCHEDULES


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int
    schedule: str
    v: int
    lower_bound: float
    cp: int = 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_fix(fix: dict) -> None:
    unknown = sorted(set(fix) - set(FIX_KEYS))
    if unknown:
        raise ValueError(f"unknown fixed setting(s) {unknown}; known: {', '.join(FIX_KEYS)}")


def tp_sizes(costs: ModelCosts, gpus: int, cluster: Cluster) -> list[int]:
    """tp sizes that divide the GPUs, stay inside a node on GPU clusters, and divide the model."""
    sizes = [t for t in _divisors(gpus) if cluster.device == "cpu" or t <= cluster.gpus_per_node]
    return [t for t in sizes if t == 1 or costs.block_profile(t) is not None]


def _schedules(req: Request, pp: int, m: int, blocks: int):
    fix = req.fix
    options = [(fix["schedule"], fix.get("v", 1))] if "schedule" in fix else list(req.schedules)
    for name, v in options:
        if "v" in fix and "schedule" not in fix and fix["v"] != v:
            continue
        if pp == 1 and (name != options[0][0] or v > 1):
            continue  # without a pipeline every schedule is the same
        if name == "interleaved-1f1b" and (m % pp or pp * v > blocks + 2):
            continue
        yield name, v


def cp_sizes(costs: ModelCosts, req: Request, rest: int) -> list[int]:
    """Context-parallel sizes: the runtime builds cp > 1 only when asked for the full space."""
    if req.runnable_only and req.fix.get("cp", 1) == 1:
        return [1]
    return [c for c in _divisors(rest) if costs.supports_cp(c, req.seq)]


def meshes(costs: ModelCosts, req: Request):
    """(dp, tp, cp, pp) with dp·tp·cp·pp = gpus that the model admits and the fix allows."""
    fix = req.fix
    for tp in tp_sizes(costs, req.gpus, req.cluster):
        for cp in cp_sizes(costs, req, req.gpus // tp):
            for pp in _divisors(req.gpus // (tp * cp)):
                dp = req.gpus // (tp * cp * pp)
                chosen = (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp))
                if any(k in fix and fix[k] != v for k, v in chosen):
                    continue
                if pp <= costs.num_blocks + 2 and req.global_batch % dp == 0:
                    yield dp, tp, cp, pp


def candidates(costs: ModelCosts, req: Request) -> list[Candidate]:
    result = []
    for dp, tp, cp, pp in meshes(costs, req):
        for b in _divisors(req.global_batch // dp):
            if "mb" in req.fix and req.fix["mb"] != b:
                continue
            m = req.global_batch // (dp * b)
            for name, v in _schedules(req, pp, m, costs.num_blocks):
                bound = _lower_bound(costs, req, Candidate(dp, tp, pp, b, m, name, v, 0.0, cp))
                if bound < math.inf or req.memory_limit == math.inf:
                    result.append(Candidate(dp, tp, pp, b, m, name, v, bound, cp))
    return sorted(result, key=lambda c: (c.lower_bound, c.pp, c.tp, c.cp, c.v))


def _strategies(req: Request, tp: int) -> list[Strategy]:
    space = strategy_space(tp, req.runnable_only)
    if "strategy" in req.fix:  # a user-fixed strategy for every block (e.g. Megatron's "tp")
        fixed = Strategy.parse(req.fix["strategy"])
        space = [fixed if tp > 1 or not fixed.tp else Strategy(recompute=fixed.recompute)]
    if "recompute" in req.fix:
        space = [s for s in space if s.recompute == req.fix["recompute"]] or \
                [Strategy(recompute=req.fix["recompute"])]
    return space


def block_costs(costs: ModelCosts, req: Request, tp: int, b: int, cp: int = 1) -> list[LayerCost]:
    return [costs.price_block(s, b, req.cluster, tp, cp) for s in _strategies(req, tp)]


def _lower_bound(costs, req, c: Candidate) -> float:
    """Iteration time if every stage were perfectly balanced with the cheapest strategy; infinite
    when even the least memory-hungry strategy, spread perfectly, cannot fit."""
    tp, pp, b, m, dp = c.tp, c.pp, c.micro_batch, c.microbatches, c.dp
    blocks = block_costs(costs, req, tp, b, c.cp)
    ends = costs.end_costs(b, req.cluster, cp=c.cp)
    options = [costs.block_option(c, dp) for c in blocks]
    least_static = min(o.static_bytes for o in options) * costs.num_blocks
    least_static += sum(costs.end_layer(c, dp).static_bytes for c in ends)
    if least_static / pp > req.memory_limit:
        return math.inf
    total = costs.num_blocks * min(o.time_s for o in options)
    total += sum(c.fwd_s + c.bwd_s for c in ends)
    alpha, beta = ilp.schedule_weights(c.schedule, pp, m, c.v)
    p2p, sync_alpha, sync_slope = _comm_terms(costs, req, c)
    boundaries = 2 * (pp * c.v - 1) * p2p  # Σ_s of the p2p terms; the busiest rank has ≥ 1/pp
    grads = costs.num_blocks * min(o.grad_bytes for o in options) / pp
    sync = sync_alpha + sync_slope * grads if sync_alpha or sync_slope else 0.0
    return alpha * (total + boundaries) + beta * (total + boundaries) / pp + sync


def _prune_dominated(options: list[ilp.BlockOption]) -> list[int]:
    """Indices of options no other option beats (≤ on every term, < on one)."""
    def key(o):
        return (o.time_s, o.static_bytes, o.act_bytes, o.grad_bytes)
    keep = []
    for i, o in enumerate(options):
        dominated = any(all(a <= b for a, b in zip(key(q), key(o))) and key(q) != key(o)
                        or (key(q) == key(o) and j < i) for j, q in enumerate(options))
        if not dominated:
            keep.append(i)
    return keep


def build_problem(costs: ModelCosts, req: Request, c: Candidate, memory_limit: float):
    """The stage ILP for a candidate, and the LayerCost behind each (non-dominated) option."""
    blocks = block_costs(costs, req, c.tp, c.micro_batch, c.cp)
    options = [costs.block_option(cost, c.dp) for cost in blocks]
    keep = _prune_dominated(options)
    options, blocks = [options[i] for i in keep], [blocks[i] for i in keep]
    embed, head = (costs.end_layer(cost, c.dp)
                   for cost in costs.end_costs(c.micro_batch, req.cluster, padded=True, cp=c.cp))
    p2p, sync_alpha, sync_slope = _comm_terms(costs, req, c)
    weights = ilp.schedule_weights(c.schedule, c.pp, c.microbatches, c.v)
    phi = tuple(f / c.v for f in peak_inflight(c.schedule, c.pp, c.microbatches, c.v))
    problem = ilp.StageProblem(costs.num_blocks, tuple(options), embed, head, c.pp, c.pp * c.v,
                               *weights, p2p, memory_limit, sync_alpha, sync_slope, phi,
                               needs_tp=c.tp > 1)
    return problem, blocks


def _comm_terms(costs, req, c: Candidate) -> tuple[float, float, float]:
    """(p2p seconds per stage boundary and micro-batch, forward + backward; exposed data-parallel
    all-reduce latency; exposed seconds per gradient byte). Ranks are laid out tp innermost, then
    cp, dp, pp: a pipeline neighbour is tp·cp·dp ranks away; gradients are averaged over the
    dp·cp ranks that hold the same weights, tp ranks apart."""
    tp, cp, dp = c.tp, c.cp, c.dp
    if c.pp > 1:
        boundary = costs.boundary_bytes(c.micro_batch) / cp
        p2p = 2 * collective_time(req.cluster, "p2p", boundary, 2, stride=tp * cp * dp)
    else:
        p2p = 0.0
    group = dp * cp
    alpha = collective_time(req.cluster, "all_reduce", 0.0, group, stride=tp)
    slope = (collective_time(req.cluster, "all_reduce", 2.0**30, group, stride=tp) - alpha) / 2**30
    exposed = 1.0 - req.cluster.dp_overlap
    return p2p, alpha * exposed, slope * exposed


def search(costs: ModelCosts, req: Request) -> list[Plan]:
    """The best plans, fastest first (at most req.top_k)."""
    check_fix(req.fix)
    found: list[Plan] = []
    for cand in candidates(costs, req):
        full = len(found) >= req.top_k
        if full and cand.lower_bound >= found[-1].predicted.iteration_s:
            break
        problem, blocks = build_problem(costs, req, cand, req.memory_limit)
        if full:  # the LP relaxation is a far tighter bound (it sees memory) at a tiny cost
            bound = ilp.solve(problem, relax=True, time_limit_s=req.time_limit_s)
            if bound.objective >= found[-1].predicted.iteration_s:
                continue
        solution = ilp.solve(problem, time_limit_s=req.time_limit_s)
        if solution.status == "infeasible":
            continue
        _keep_best_per_configuration(found, make_plan(costs, req, cand, problem, blocks, solution))
        del found[req.top_k:]
    return found


def _keep_best_per_configuration(found: list[Plan], plan: Plan) -> None:
    """Alternatives differ in mesh or schedule: a plan only replaces a slower one of its kind."""
    def kind(p: Plan):
        return p.dp, p.tp, p.pp, p.cp, p.schedule, p.virtual_stages
    same = [p for p in found if kind(p) == kind(plan)]
    if same and same[0].predicted.iteration_s <= plan.predicted.iteration_s:
        return
    found[:] = [p for p in found if kind(p) != kind(plan)] + [plan]
    found.sort(key=lambda p: p.predicted.iteration_s)


def smallest_memory(costs: ModelCosts, req: Request) -> tuple[float, Candidate | None]:
    """The least peak memory per device any candidate needs (for infeasibility errors)."""
    best, where = math.inf, None
    seen = set()
    unlimited = replace(req, memory_limit=math.inf)
    for cand in sorted(candidates(costs, unlimited), key=lambda c: c.micro_batch):
        kind = (cand.dp, cand.tp, cand.pp, cand.cp, cand.schedule, cand.v)
        if kind in seen:  # a larger micro-batch only adds activation memory
            continue
        seen.add(kind)
        problem, _ = build_problem(costs, req, cand, math.inf)
        sol = ilp.solve(problem, objective="memory", time_limit_s=req.time_limit_s)
        if sol.status != "infeasible" and sol.objective < best:
            best, where = sol.objective, cand
    return best, where


def make_plan(costs, req, cand, problem, blocks, solution) -> Plan:
    stages, index = [], 0
    prefix = costs.block_prefix
    for s, counts in enumerate(solution.counts):
        names = ["embed"] if s == 0 and costs.has("embed") else []
        strategies = ["vocab-tp" if costs.vocab_parallel(cand.tp) else "none"] * len(names)
        for k, count in enumerate(counts):
            names += [f"{prefix}.{index + i}" for i in range(count)]
            strategies += [problem.options[k].name] * count
            index += count
        if s == problem.stages - 1 and costs.has("head"):
            names.append("head")
            strategies.append("vocab-tp" if costs.vocab_parallel(cand.tp) else "none")
        stages.append(_stage_plan(costs, problem, s, counts, tuple(names), tuple(strategies),
                                  cand.dp))
    return Plan(req.model_name, req.gpus, req.cluster.name, cand.dp, cand.tp, cand.pp,
                cand.micro_batch, cand.microbatches, req.global_batch, req.seq, cand.schedule,
                req.memory_limit, tuple(stages), _predict(costs, req, cand, problem, blocks,
                                                          solution.counts),
                costs.notes(), f"{solution.status}, gap {solution.gap:.2%}, "
                               f"{solution.seconds:.2f} s", cand.v, cand.cp)


def _stage_plan(costs, problem, s, counts, names, strategies, dp) -> StagePlan:
    phi = problem.act_factor[problem.rank_of(s)]
    ends = ilp._ends(problem, s)
    static = sum(c * o.static_bytes for c, o in zip(counts, problem.options))
    static += sum(e.static_bytes for e in ends)
    weights, opt = costs.split_static(static, dp)
    act = phi * (sum(c * o.act_bytes for c, o in zip(counts, problem.options))
                 + sum(e.act_bytes for e in ends))
    return StagePlan(names, strategies, _time_of(problem, counts, s), weights, opt, act)


def _time_of(problem, counts, s) -> float:
    padded = [()] * problem.stages
    padded[s] = counts
    return ilp.stage_time(problem, padded, s)


def _predict(costs, req, cand, problem, blocks, counts) -> Predicted:
    iteration, peak = ilp.evaluate(problem, counts)
    m = cand.microbatches
    rank_times = [sum(_time_of(problem, counts[s], s) for s in problem.stages_of(r))
                  for r in range(problem.ranks)]
    busiest = rank_times.index(max(rank_times))
    comm = {o.name: b.comm_s for o, b in zip(problem.options, blocks)}
    comm_per_mb = sum(c * comm[o.name] for s in problem.stages_of(busiest)
                      for c, o in zip(counts[s], problem.options))
    comm_per_mb += sum(ilp._p2p(problem, s) for s in problem.stages_of(busiest))
    busy = m * max(rank_times)
    sync = iteration - problem.sum_weight * sum(_time_of(problem, counts[s], s)
                                                for s in range(problem.stages)) \
        - problem.max_weight * max(rank_times)
    bubble = max(iteration - busy - sync, 0.0)  # rounding can leave -1e-19
    flops = req.global_batch * costs.flops_per_sample()
    return Predicted(iteration, busy - m * comm_per_mb, m * comm_per_mb + sync, bubble,
                     bubble / busy, peak, req.global_batch * req.seq / iteration,
                     flops / iteration / req.gpus / 1e12)
