"""The outer search: every mesh (dp, tp, cp, pp), micro-batching and schedule, each solved by the
stage ILP (planner.search.ilp).

Configurations are visited best first by a lower bound on their iteration time: first
`_lower_bound` (the cheapest strategy everywhere, stages balanced as well as whole blocks allow),
then, once a configuration comes up, its LP relaxation, which also sees memory. The search stops
once the least bound left cannot beat the k-th best plan found, and each ILP it does solve gets
that plan's time as a cutoff, so HiGHS abandons a configuration as soon as it cannot win. All of
it is exact: whatever is skipped is provably no faster than the k-th best. Only a node limit (the
same in every run) or the time limit behind it can leave a configuration open; the plans then
report the gap to its proven bound and which limit stopped it. Strategies that
another strategy beats on time, memory and gradient bytes at once are pruned before the ILP sees
them. A configuration's stage problem is planner.search.problem's.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache

from cost_model.hardware.cluster import Cluster
from cost_model.layers.layer_cost import LayerCost
from cost_model.layers.sharding import Sharding, SyncParts
from cost_model.layers.strategy import RECOMPUTE, Strategy
from planner.search import ilp
from planner.search.costs import ModelCosts, PlanningError  # noqa: F401 - re-exported
from planner.search.plan import Plan
from planner.search.problem import (Candidate, Request, build_problem, comm_terms, least_sync,
                                    p2p_time, strategies, sync_parts, device_bytes)
from planner.search.solved import make_plan, read_solver_text, solver_text
from planner.search import zero as zero_axis
from runtime.pipeline.generators import SCHEDULES as RUNTIME_SCHEDULES
from runtime.pipeline.generators import schedule_error
from runtime.pipeline.split_backward import SPLIT_BACKWARDS

FIX_KEYS = ("dp", "tp", "pp", "cp", "mb", "v", "schedule", "strategy", "recompute", "zero",
            "dp_shard", "ep", "split_backward")

@lru_cache(maxsize=None)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


FIX_NUMBERS = ("dp", "tp", "pp", "cp", "mb", "v", "ep")
MESH_KEYS = ("dp", "tp", "pp", "cp")


def parse_fix(text: str) -> dict:
    """'tp=8,pp=8,mb=1,strategy=tp' -> {'tp': 8, 'pp': 8, 'mb': 1, 'strategy': 'tp'} (`fxpar plan
    --fix`, a training config's [parallel] plan), checked item by item (`check_fix`); a
    ValueError naming the item and the key's legal values otherwise."""
    result: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq:
            raise ValueError(f"item {item!r} is not key=value")
        if key not in FIX_KEYS:
            raise ValueError(f"unknown key {key!r} in {item!r}; known keys: {', '.join(FIX_KEYS)}")
        if key in result:
            raise ValueError(f"{key} is given twice")
        if key in FIX_NUMBERS:
            if not value.isdigit():
                raise ValueError(f"bad item {item!r}: {key} must be a positive integer "
                                 f"(1, 2, 3, ...)")
            value = int(value)
        elif key in ("zero", "dp_shard") and value.isdigit():  # planner.search.zero checks the rest
            value = int(value)
        result[key] = value
        try:
            check_fix({key: value})
        except ValueError as err:
            raise ValueError(f"bad item {item!r}: {err}") from None
    check_fix(result)
    return result


def check_fix(fix: dict) -> None:
    """Refuse fixed settings that no plan can have, naming the key and its legal values."""
    zero_axis.check_zero_fix(fix)
    for key, value in fix.items():
        if key not in FIX_KEYS:
            raise ValueError(f"unknown fixed setting {key!r}; known: {', '.join(FIX_KEYS)}")
        if key in FIX_NUMBERS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer (1, 2, 3, ...), got {value!r}")
        elif key == "schedule" and value not in RUNTIME_SCHEDULES:
            raise ValueError(f"unknown schedule {value!r}; legal schedules: "
                             f"{', '.join(sorted(RUNTIME_SCHEDULES))}")
        elif key == "strategy":
            if not isinstance(value, str):
                raise ValueError(f"strategy must be a string such as 'tp+sp', got {value!r}")
            Strategy.parse(value)  # its message lists the legal forms
        elif key == "recompute" and value not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {value!r}")
    _check_split_backward(fix)
    name, v = fix.get("schedule"), fix.get("v", 1)
    if name is not None and name != "interleaved-1f1b" and v > 1:
        raise ValueError(f"v={v} stages per rank needs schedule=interleaved-1f1b: schedule "
                         f"{name!r} runs one stage per rank (legal v: 1)")
    if "strategy" in fix and "recompute" in fix:
        strategy = Strategy.parse(fix["strategy"])
        if strategy.recompute != fix["recompute"]:
            wanted = replace(strategy, recompute=fix["recompute"])
            raise ValueError(f"strategy={fix['strategy']} (recompute {strategy.recompute}) "
                             f"contradicts recompute={fix['recompute']}; fix strategy={wanted} "
                             f"alone")


def _check_split_backward(fix: dict) -> None:
    """split_backward (runtime.pipeline.split_backward) says how ZB-H1's W runs: only with
    schedule=zb-h1, and "record" never through recomputed blocks."""
    if "split_backward" not in fix:
        return
    value = fix["split_backward"]
    if value not in SPLIT_BACKWARDS:
        raise ValueError(f"split_backward must be one of {', '.join(SPLIT_BACKWARDS)}, "
                         f"got {value!r}")
    if fix.get("schedule", "zb-h1") != "zb-h1":
        raise ValueError(f"split_backward={value} needs schedule=zb-h1 (only ZB-H1 splits its "
                         f"backward), got schedule={fix['schedule']}")
    recompute = fix.get("recompute") or (Strategy.parse(fix["strategy"]).recompute
                                         if "strategy" in fix else "none")
    if value == "record" and recompute != "none":
        raise ValueError(f"split_backward=record records gradients no recomputed block keeps: "
                         f"fix recompute=none, or split_backward=retraverse for "
                         f"recompute={recompute}")


def tp_sizes(costs: ModelCosts, gpus: int, cluster: Cluster) -> list[int]:
    """tp sizes that divide the GPUs, stay inside a node on GPU clusters, and divide the model."""
    sizes = [t for t in divisors(gpus) if cluster.device == "cpu" or t <= cluster.gpus_per_node]
    return [t for t in sizes if t == 1 or costs.block_profile(t) is not None]


def cp_sizes(costs: ModelCosts, req: Request, rest: int) -> list[int]:
    """Context-parallel sizes: those whose sequence splits into 2·cp zig-zag chunks, for a model
    whose attention passes.rewrite.context_parallel can turn into a ring (ModelCosts.supports_cp)."""
    return [c for c in divisors(rest) if costs.supports_cp(c, req.seq)]


@dataclass(frozen=True)
class Refusal:
    """Why a filter of the search drops a configuration: `depth` orders the filters (the deepest
    refusal is the one that removed the last configurations), `keys` the fixed settings it can
    blame, most direct first."""
    depth: int
    reason: str
    keys: tuple[str, ...]


def factorisations(gpus: int):
    """Every (dp, tp, cp, pp) with dp·tp·cp·pp = gpus, tp outermost (the search's order)."""
    for tp in divisors(gpus):
        for cp in divisors(gpus // tp):
            for pp in divisors(gpus // (tp * cp)):
                yield gpus // (tp * cp * pp), tp, cp, pp


def mesh_refusal(costs: ModelCosts, req: Request, dp: int, tp: int, cp: int,
                  pp: int) -> Refusal | None:
    cluster, layers = req.cluster, costs.num_blocks + 2
    if cluster.device != "cpu" and tp > cluster.gpus_per_node:
        return Refusal(1, f"tp={tp} spans more than the {cluster.gpus_per_node} GPUs of one "
                          f"{cluster.name} node", ("tp",))
    if tp > 1 and costs.block_profile(tp) is None:
        return Refusal(2, costs.tp_errors[tp], ("tp",))
    if not costs.supports_cp(cp, req.seq):
        return Refusal(3, costs.cp_error or f"sequence length {req.seq} is not divisible by "
                          f"2·cp = {2 * cp} (zig-zag context parallel)", ("cp",))
    if pp > layers:
        return Refusal(4, f"pp={pp} exceeds the {layers} layers ({costs.num_blocks} blocks, "
                          f"embed and head): every stage needs one", ("pp",))
    if req.global_batch % dp:
        return Refusal(5, f"global batch {req.global_batch} is not divisible by dp={dp}", ("dp",))
    if (dp * cp) % costs.ep:  # expert parallel ranks are carved from dp x cp (expert_search)
        return Refusal(5, f"ep={costs.ep} does not divide dp x cp = {dp * cp}", ("ep", "dp"))
    if tp > 1 and not strategies(req, tp, costs, cp):
        read = "dim 1 of the first example input" in req.sizes_from  # not said to be one
        split = (f"each rank's {req.seq // cp} positions do not split over tp={tp} ranks"
                 + ("; the sequence is dim 1 of the first example input: if the inputs are "
                    "not sequences (images), plan with sequence_dim=None" if read else "")
                 if (req.seq // cp) % tp else
                 f"the block's sequence-parallel rewrite stops: {costs.sp_error(tp)}")
        return Refusal(6, f"strategy={req.fix['strategy']}: sequence parallel does not apply "
                          f"({split})", ("strategy",))
    if tp == 1 and "tp" not in req.fix and Strategy.parse(req.fix.get("strategy", "none")).tp:
        # asked for tensor parallelism, not for a mesh: tp=1 meshes would drop it (a fixed tp=1
        # keeps the strategy's recompute, the plan saying so: solved.tp_unused)
        return Refusal(6, f"strategy={req.fix['strategy']} splits every block over tp ranks; "
                          f"tp=1 has none (fix tp > 1, or a strategy without tp)",
                       ("tp", "strategy"))
    if tp > 1 and not any(s.tp for s in strategies(req, tp)):
        return Refusal(6, f"strategy={req.fix['strategy']} leaves tp={tp} unused (a tp > 1 mesh "
                          f"needs some block to use tensor parallelism)", ("tp", "strategy"))
    if dp % req.fix.get("dp_shard", 1):  # planner.search.zero: shard groups split dp
        return Refusal(6, f"dp_shard={req.fix['dp_shard']} does not divide dp={dp}",
                       ("dp_shard",))
    return None


def schedule_options(req: Request) -> list[tuple[str, int]]:
    """(schedule, v) pairs the fix allows: a fixed schedule with the fixed v or the v the search
    gives it; a fixed v alone picks interleaving when above 1, a fixed split_backward ZB-H1."""
    fix = req.fix
    if "schedule" in fix or "split_backward" in fix:
        name = fix.get("schedule", "zb-h1")
        return [(name, fix.get("v", dict(req.schedules).get(name, 1)))]
    if "v" in fix:
        interleaved = fix["v"] > 1
        return [(name, fix["v"]) for name, _ in req.schedules
                if (name == "interleaved-1f1b") == interleaved]
    return list(req.schedules)


def schedule_refusal(pp: int, m: int, blocks: int, name: str, v: int) -> Refusal | None:
    if pp == 1 and v > 1:
        return Refusal(8, f"{name} with v={v} stages per rank needs a pipeline, but pp=1",
                       ("v", "pp"))
    if name == "interleaved-1f1b" and m % pp:
        return Refusal(8, f"interleaved-1f1b needs the {m} micro-batches to be a multiple of "
                          f"pp={pp}", ("mb", "pp", "dp", "schedule"))
    if name == "interleaved-1f1b" and pp * v > blocks + 2:
        return Refusal(8, f"interleaved-1f1b with pp={pp} and v={v} makes {pp * v} stages, more "
                          f"than the {blocks + 2} layers", ("v", "pp"))
    why = schedule_error(name, pp, m, v)  # whatever else the runtime would refuse
    return Refusal(8, why, ("schedule", "v")) if why else None


def _schedules(req: Request, pp: int, m: int, blocks: int):
    options = schedule_options(req)
    for name, v in options:
        if pp == 1 and name != options[0][0]:
            continue  # without a pipeline every schedule is the same
        if schedule_refusal(pp, m, blocks, name, v) is None:
            yield name, v


def fixed_mesh(req: Request, dp: int, tp: int, cp: int, pp: int) -> bool:
    return all(req.fix.get(k, value) == value for k, value in zip(("dp", "tp", "cp", "pp"),
                                                                   (dp, tp, cp, pp)))


def meshes(costs: ModelCosts, req: Request):
    """(dp, tp, cp, pp) with dp·tp·cp·pp = gpus that the model admits and the fix allows."""
    tp_sizes(costs, req.gpus, req.cluster)  # probe every tp size: the notes say which divide
    for mesh in factorisations(req.gpus):
        if fixed_mesh(req, *mesh) and mesh_refusal(costs, req, *mesh) is None:
            yield mesh


def _batchings(costs: ModelCosts, req: Request):
    """(dp, tp, cp, pp, micro-batch, micro-batches, schedules, ZeRO options) in the search's
    order: the configurations of each mesh and micro-batch are its (schedule, v) pairs times its
    (level, dp_shard) pairs (planner.search.zero.zero_options)."""
    schedules, zeros = {}, {}  # both depend on only part of a configuration: work them out once
    for dp, tp, cp, pp in meshes(costs, req):
        if (dp, cp, tp) not in zeros:
            zeros[dp, cp, tp] = zero_axis.zero_options(req.fix, dp, cp, tp,
                                                       req.cluster.gpus_per_node)
        for b in divisors(req.global_batch // dp):
            if "mb" in req.fix and req.fix["mb"] != b:
                continue
            m = req.global_batch // (dp * b)
            if (pp, m) not in schedules:
                schedules[pp, m] = list(_schedules(req, pp, m, costs.num_blocks))
            yield dp, tp, cp, pp, b, m, schedules[pp, m], zeros[dp, cp, tp]


def configurations(costs: ModelCosts, req: Request):
    """Every candidate the filters let through (memory aside), with lower_bound 0."""
    for dp, tp, cp, pp, b, m, schedules, zeros in _batchings(costs, req):
        for name, v in schedules:
            for level, shard in zeros:
                for split in split_forms(req, name):
                    yield Candidate(dp, tp, pp, b, m, name, v, 0.0, cp, level,
                                    shard if shard != dp else 0, split)


def candidates(costs: ModelCosts, req: Request) -> list[Candidate]:
    """The configurations whose least static memory fits, each with its lower bound, best first."""
    least, result = _LeastCosts(costs, req), []
    for dp, tp, cp, pp, b, m, schedules, zeros in _batchings(costs, req):
        fits = []  # (level, dp_shard) pairs whose least static memory fits
        for level, shard in zeros:
            if least.static_bytes(tp, cp, b, level, shard * cp if level else 1) / pp > \
                    req.memory_limit:
                continue  # even the least memory-hungry strategy, spread perfectly, cannot fit
            fits.append((level, shard if shard != dp else 0))
        for name, v in schedules if fits else ():
            # the bound without ZeRO, and its σ: the ZeRO levels differ only in σ
            bound, sync = least.bound(Candidate(dp, tp, pp, b, m, name, v, 0.0, cp))
            for level, dp_shard in fits:
                own = bound
                if level or dp_shard:
                    own += least.sync_bound(Candidate(dp, tp, pp, b, m, name, v, 0.0, cp, level,
                                                      dp_shard)) - sync
                result += [Candidate(dp, tp, pp, b, m, name, v, own, cp, level, dp_shard, split)
                           for split in split_forms(req, name)]
    return sorted(result, key=lambda c: (c.lower_bound, c.pp, c.tp, c.cp, c.v, c.split_backward))


def split_forms(req: Request, schedule: str) -> tuple[str, ...]:
    """The forms of ZB-H1's split backward the search tries (runtime.pipeline.split_backward):
    W walking the graph again (""), and W from the gradients I recorded ("record": no second
    walk, the records held from I to W), which no recomputed block takes, so it is tried only
    where the fix leaves recompute=none possible. The lower bound (`_lower_bound`) leaves both
    out, so it bounds either."""
    if schedule != "zb-h1":
        return ("",)
    fixed = req.fix.get("split_backward")
    if fixed is not None:
        return ("record",) if fixed == "record" else ("",)
    recompute = req.fix.get("recompute") or (Strategy.parse(req.fix["strategy"]).recompute
                                             if "strategy" in req.fix else "none")
    return ("", "record") if recompute == "none" else ("",)


@dataclass(frozen=True)
class _Least:
    """Per-term minima over a mesh's strategies (each may come from a different strategy) and the
    end layers' terms: what every plan of the mesh and micro-batch pays at least, whatever its
    ZeRO level (static bytes, which the level changes, are `_LeastCosts.static_bytes`)."""
    block_s: float             # the least over every kind
    embed_s: float
    head_s: float
    end_grad_bytes: float
    blocks_s: float            # Σ over the blocks of their own kind's least time
    blocks_grad_bytes: float   # likewise for gradient bytes


class _LeastCosts:
    """The least costs behind one request's lower bounds (`_lower_bound`), each worked out once:
    the bounds of thousands of configurations share a few hundred (tp, cp, micro-batch) prices.

    Recomputation only adds backward time and never changes the parameters, so the minima over a
    strategy space are at least those over its recompute-free twins: pricing those (3
    strategies rather than 12 at tp > 1) bounds every candidate at a quarter of the cost.
    tests/unit/test_search_bounds.py holds the cost model to that."""

    def __init__(self, costs: ModelCosts, req: Request):
        self.costs, self.req = costs, req
        self._twins, self._kinds, self._ends, self._least = {}, {}, {}, {}
        self._layout_of, self._layouts, self._static = {}, {}, {}
        self._p2p, self._sync = {}, {}

    def twins(self, tp: int, cp: int, kind: int = 0) -> list[Strategy]:
        if (tp, cp, kind) not in self._twins:
            self._twins[tp, cp, kind] = sorted({replace(s, recompute="none") for s in
                                                strategies(self.req, tp, self.costs, cp, kind)})
        return self._twins[tp, cp, kind]

    def kind(self, tp: int, cp: int, b: int, kind: int) -> tuple[float, LayerCost, float]:
        """(least time, the twin with the fewest parameters, least gradient bytes) of a block of
        `kind`. Static bytes grow with the parameters under every ZeRO level (a rank's share of
        them, plus whole expert weights), so that twin also holds the least static bytes."""
        key = (tp, cp, b, kind)
        if key not in self._kinds:
            costs, cluster = self.costs, self.req.cluster
            priced = [costs.price_block(s, b, cluster, tp, cp, kind)
                      for s in self.twins(tp, cp, kind)]
            options = [costs.block_option(cost) for cost in priced]
            lightest = min(range(len(priced)), key=lambda i: priced[i].params)
            self._kinds[key] = (min(o.time_s for o in options), priced[lightest],
                                min(o.grad_bytes for o in options))
        return self._kinds[key]

    def ends(self, tp: int, cp: int, b: int):
        if (tp, cp, b) not in self._ends:
            self._ends[tp, cp, b] = self.costs.end_costs(b, self.req.cluster, padded=True, cp=cp,
                                                         tp=tp)
        return self._ends[tp, cp, b]

    def terms(self, tp: int, cp: int, b: int) -> _Least:
        if (tp, cp, b) not in self._least:
            costs = self.costs
            least = [self.kind(tp, cp, b, kind) for kind in range(len(costs.kinds))]
            embed, head = (costs.end_layer(c) for c in self.ends(tp, cp, b))
            def total(term: int) -> float:
                return sum(n * least[kind][term] for kind, n in costs.runs)
            self._least[tp, cp, b] = _Least(
                min(t for t, _, _ in least), embed.time_s, head.time_s,
                embed.grad_bytes + head.grad_bytes, total(0), total(2))
        return self._least[tp, cp, b]

    def static_bytes(self, tp: int, cp: int, b: int, level: int, n: int) -> float:
        """The least static bytes of all blocks and both ends at ZeRO `level` over shard groups
        of n ranks (1 at level 0)."""
        key = (self.layout(tp, cp, b), level, n)
        if key not in self._static:
            (blocks, ends), costs = self._layouts[key[0]], self.costs
            memory = Sharding(level, n)  # the level's memory shares
            total = sum(count * costs.block_static(blocks[kind], memory)
                        for kind, count in costs.runs)
            embed, head = (costs.end_layer(c, memory) for c in ends)
            self._static[key] = total + embed.static_bytes + head.static_bytes
        return self._static[key]

    def layout(self, tp: int, cp: int, b: int) -> tuple:
        """What static bytes depend on: the parameters (and layer, whose experts stay whole) of
        each kind's lightest twin and of the end layers. Thousands of configurations share a few
        layouts, so `static_bytes` works each one out once per ZeRO level and shard group."""
        if (tp, cp, b) not in self._layout_of:
            blocks = tuple(self.kind(tp, cp, b, kind)[1] for kind in range(len(self.costs.kinds)))
            ends = self.ends(tp, cp, b)
            layout = (tuple((c.params, c.layer) for c in blocks),
                      tuple(None if c is None else c.params for c in ends))
            self._layouts.setdefault(layout, (blocks, ends))  # its costs, to price it with
            self._layout_of[tp, cp, b] = layout
        return self._layout_of[tp, cp, b]

    def bound(self, c: Candidate) -> tuple[float, float]:
        """(`_lower_bound`, its σ) of a candidate."""
        least, (p2p, parts, units) = self.terms(c.tp, c.cp, c.micro_batch), self.comm_terms(c)
        grads = (least.blocks_grad_bytes + least.end_grad_bytes) / c.pp
        return (_lower_bound(self.costs, self.req, c, least, p2p, parts, units),
                least_sync(parts, units, grads, self.req.cluster))

    def sync_bound(self, c: Candidate) -> float:
        """σ of `_lower_bound`: the data-parallel collectives of the average rank."""
        least, (_, parts, units) = self.terms(c.tp, c.cp, c.micro_batch), self.comm_terms(c)
        grads = (least.blocks_grad_bytes + least.end_grad_bytes) / c.pp
        return least_sync(parts, units, grads, self.req.cluster)

    def comm_terms(self, c: Candidate) -> tuple[float, SyncParts, int]:
        """`comm_terms`, its collectives priced once per size and stride."""
        p2p_key = (c.pp > 1, c.micro_batch, c.cp, c.tp * c.cp * c.dp)
        if p2p_key not in self._p2p:
            self._p2p[p2p_key] = p2p_time(self.costs, self.req, c)
        sync_key = (c.zero, c.dp_shard, c.dp, c.cp, c.tp, c.pp, c.microbatches, c.schedule) \
            if c.zero or c.dp_shard else (0, 0, c.dp * c.cp, 1, c.tp, c.pp)
        if sync_key not in self._sync:
            self._sync[sync_key] = sync_parts(self.costs, self.req, c)
        return (self._p2p[p2p_key], *self._sync[sync_key])


def _lower_bound(costs: ModelCosts, req: Request, c: Candidate, least: _Least, p2p: float,
                 parts: SyncParts, units: int) -> float:
    """A bound no plan of the candidate beats: the ILP objective α·Σ_s T_s + β·ρ + σ with every
    block at its cheapest (t_min, g_min: minima over the strategies), where

      Σ_s T_s ≥ Σ_j N_j·t_min,j + E + H + 2(S − 1)·c   (each run at its kind's cheapest; every
                                                  stage boundary is crossed twice)
      ρ       ≥ max(Σ_s T_s / p,  ρ*)             (ρ*: ilp.busiest_rank_floor, whole blocks)
      σ       ≥ a + b·(Σ_j N_j·g_min,j + g_E + g_H) / p   (the busiest rank holds ≥ the average)

    ρ* is what makes it tight for deep pipelines — 96 blocks on 64 ranks put 2 blocks on some
    rank, not 1.5 — and with it the first candidate is usually the optimum (gpt3-175b on 1024
    GPUs: within 0.01% of the ILP optimum on sampled candidates). (p2p, parts, units):
    `comm_terms` of the candidate."""
    blocks, stages = costs.num_blocks, c.pp * c.v
    total = (least.blocks_s + least.embed_s + least.head_s
             + 2 * (stages - 1) * p2p)
    floor = ilp.busiest_rank_floor(blocks, c.pp, stages, least.block_s, least.embed_s,
                                   least.head_s, p2p)
    rho = max(total / c.pp, floor)
    grads = (least.blocks_grad_bytes + least.end_grad_bytes) / c.pp
    sync = least_sync(parts, units, grads, req.cluster)
    alpha, beta = ilp.schedule_weights(c.schedule, c.pp, c.microbatches, c.v)
    return alpha * total + beta * rho + sync




def search(costs: ModelCosts, req: Request,
           ordered: list[Candidate] | None = None) -> list[Plan]:
    """The best plans, fastest first (at most req.top_k); `ordered`: `candidates(costs, req)`,
    when the caller has them already.

    Best first over lower bounds: a candidate enters the queue with `_lower_bound`; when it
    first comes out, its LP relaxation (which sees memory, so it is far tighter) replaces that
    bound and it goes back in; when it comes out again, its ILP is solved with the k-th best
    time as cutoff. The search ends when the smallest bound left cannot beat that time."""
    check_fix(req.fix)
    if req.fix.get("ep", costs.ep) != costs.ep:  # planner.search.experts sets costs.ep
        raise ValueError(f"ep={req.fix['ep']} is planned by planner.search.experts (fxpar plan, "
                         f"planner.api.plan); this path plans without expert parallelism")
    start = time.perf_counter()
    found: list[Plan] = []
    open_bound = math.inf  # least proven bound among ILPs a node or time limit stopped
    timed_out = False      # one of them by the time limit: a rerun may differ
    ordered = candidates(costs, req) if ordered is None else ordered
    queue = [(c.lower_bound, i, c, None) for i, c in enumerate(ordered)]
    solve = _solver()
    heapq.heapify(queue)  # already sorted, so already a heap; (bound, i) are unique keys
    # A simulated step (planner.search.step_prediction) may come out below the ILP's bounds: no
    # candidate can be ruled out by them, so every one is solved (such clusters are CPU hosts:
    # few ranks, few candidates).
    exhaustive = req.cluster.runtime_priced
    while queue:
        bound, i, cand, built = heapq.heappop(queue)
        cutoff = found[-1].predicted.iteration_s if len(found) >= req.top_k else req.cutoff_s
        cutoff = math.inf if exhaustive else cutoff
        if bound >= cutoff:
            break  # every bound left is at least this one: nothing left can enter the list
        if built is None:
            built = build_problem(costs, req, cand, req.memory_limit)
            relaxed = solve(built[0], relax=True, time_limit_s=req.time_limit_s)
            if relaxed.status not in ("infeasible", "cutoff"):
                heapq.heappush(queue, (max(bound, _finite(relaxed.bound, bound)), i, cand, built))
            continue
        solution = solve(built[0], time_limit_s=req.time_limit_s, cutoff=cutoff)
        if solution.status in ("feasible", "unsolved"):
            open_bound = min(open_bound, max(bound, _finite(solution.bound, bound)))
            timed_out = timed_out or solution.stop == "time limit"
        if solution.status in ("optimal", "feasible"):
            solution = ilp.polish(built[0], solution, req.time_limit_s)
            plan = make_plan(costs, req, cand, *built, solution)
            _keep_best_per_configuration(found, plan)
            del found[req.top_k:]
    seconds = round(time.perf_counter() - start, 4)
    return [replace(_with_search_gap(p, open_bound, timed_out),
                    timing={**p.timing, "search_s": seconds}) for p in found]


def _solver():
    """ilp.solve, remembering its answers: configurations the cost model prices alike (cp
    ranks instead of dp ranks with a larger micro-batch, say) pose the same stage problem, and
    HiGHS answers a problem asked again as it did the first time (the time limit aside, and then
    the first answer is as good as a second)."""
    answers = {}
    def solve(problem: ilp.StageProblem, **options) -> ilp.Solution:
        key = (problem, tuple(sorted(options.items())))
        if key not in answers:
            answers[key] = ilp.solve(problem, **options)
        return answers[key]
    return solve


def _finite(x: float, default: float) -> float:
    return x if math.isfinite(x) else default


def _with_search_gap(plan: Plan, open_bound: float, timed_out: bool = False) -> Plan:
    """A plan is proven optimal only if no configuration a node or time limit stopped could beat
    it; otherwise it reports the gap to the least bound left open (as HiGHS would for one ILP),
    and which limit stopped the search (solved.solver_text)."""
    time_s = plan.predicted.iteration_s
    if open_bound >= time_s * (1 - 1e-9):
        return plan
    status, own, stop = read_solver_text(plan.solver)
    gap = max(own if status == "feasible" else 0.0, (time_s - open_bound) / time_s)
    limit = "time limit" if timed_out else stop or "node limit"
    return replace(plan, solver=solver_text("feasible", gap, limit))


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
        kind = (cand.dp, cand.tp, cand.pp, cand.cp, cand.schedule, cand.v, cand.zero,
                cand.dp_shard)
        if kind in seen:  # a larger micro-batch only adds activation memory
            continue
        seen.add(kind)
        problem, _ = build_problem(costs, req, cand, math.inf)
        sol = ilp.solve(problem, objective="memory", time_limit_s=req.time_limit_s)
        need = device_bytes(costs, req, cand, sol.objective)   # and the device's own terms
        if sol.status != "infeasible" and need < best:
            best, where = need, cand
    return best, where
