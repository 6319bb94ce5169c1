"""Price a configuration stated elsewhere (a Megatron-LM command line, a torchtitan TOML, the
nearest configuration such a framework can express) with fxpar's own cost model.

A `Configuration` is what those frameworks fix: the mesh, micro-batch, schedule, and either the
blocks of every (virtual) stage with their strategies, or one strategy for every block and the
stage split left to fxpar. `Pricer.price` prices it:

* with `stages`, exactly that layout: the stage ILP's own problem for the mesh (as `--fix` builds
  it: the same filters and refusals) evaluated at the given block counts, with no search, so a
  plan's own layout prices to the plan's own prediction;
* without, as `--fix` would: the search with those settings fixed places the blocks.

Expert parallelism (`ep`, carved from the dp x cp ranks) prices every MoE block at that size as
the search does (planner.search.experts), both ways.

A configuration that does not fit the memory limit is still priced (at no limit) and says so:
`fits` is False and `Priced.note` gives the peak against the limit.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

from cost_model.hardware.cluster import get_cluster
from cost_model.layers.strategy import Strategy
from planner.search import ilp
from planner.search.plan import Plan, gib
from planner.search import zero as zero_axis
from planner.search.experts import ep_pricing, ep_sizes, search_experts, set_ep
from planner.search.refusals import why_nothing_plans
from planner.search.meshes import (Request, check_fix, configurations, make_plan, search,
                                   tp_sizes)
from planner.search.problem import runtime_terms, stage_problem

ENDS = ("auto", "vocab-tp", "none")


@dataclass(frozen=True)
class Configuration:
    """dp × tp × pp × cp ranks, `ep` of the dp × cp ranks sharing each MoE layer's experts,
    micro-batches of `micro_batch`, a pipeline schedule with `v` stages per rank; `stages`: the
    block strategies of each of the pp·v stages in order (None: fxpar splits the blocks, every
    block `strategy`); `ends`: embedding and head "vocab-tp" (split over the vocabulary),
    "none" (replicated) or "auto" (fxpar's choice)."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"
    v: int = 1
    stages: tuple[tuple[str, ...], ...] | None = None
    strategy: str | None = None
    ends: str = "auto"
    zero: int = 0                  # sharded data parallel level (planner.search.zero)
    dp_shard: int | None = None    # ranks per shard group (hybrid sharding); None: all of dp
    split_backward: str = ""       # Plan.split_backward: "record", or "" for W walking again
    ep: int = 1                    # expert-parallel ranks (Plan.ep)

    def __post_init__(self):
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive integer, got {self.ep!r}")
        if self.ends not in ENDS:
            raise ValueError(f"ends must be one of {', '.join(ENDS)}, got {self.ends!r}")
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(
                tuple(str(Strategy.parse(s)) for s in stage) for stage in self.stages))
        if self.strategy is not None:
            object.__setattr__(self, "strategy", str(Strategy.parse(self.strategy)))
        if self.dp_shard == self.dp:  # one shard group of all dp ranks: plain sharding
            object.__setattr__(self, "dp_shard", None)
        if self.dp * self.cp == 1:  # nothing to shard over (levels shard over dp x cp)
            object.__setattr__(self, "zero", 0)

    def fix(self) -> dict:
        """The --fix settings of this configuration (the strategy only when it is one for all)."""
        fix = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "mb": self.micro_batch,
               "schedule": self.schedule, "v": self.v, "zero": self.zero}
        if self.dp_shard and self.dp_shard != self.dp:
            fix["dp_shard"] = self.dp_shard
        if self.split_backward:
            fix["split_backward"] = self.split_backward
        if self.ep > 1:  # (ep=1 left out, as a dense model's configuration reads)
            fix["ep"] = self.ep
        strategy = self.uniform_strategy()
        if strategy is not None:
            fix["strategy"] = strategy
        return fix

    def fix_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.fix().items())

    def uniform_strategy(self) -> str | None:
        if self.stages is None:
            return self.strategy
        names = {s for stage in self.stages for s in stage}
        return names.pop() if len(names) == 1 else None

    @staticmethod
    def of(plan: Plan) -> "Configuration":
        """A plan's own configuration: its mesh, schedule and every stage's block strategies."""
        ends = {s for st in plan.stages for layer, s in zip(st.layers, st.strategies)
                if layer in ("embed", "head")} if plan.tp > 1 else set()  # tp 1: nothing to split
        return Configuration(plan.dp, plan.tp, plan.pp, plan.cp, plan.micro_batch, plan.schedule,
                             plan.virtual_stages, block_strategies(plan),
                             ends=ends.pop() if len(ends) == 1 else "auto", zero=plan.zero,
                             dp_shard=plan.dp_shard, split_backward=plan.split_backward,
                             ep=plan.ep)


def block_strategies(plan: Plan) -> tuple[tuple[str, ...], ...]:
    """The strategies of each stage's blocks (its end layers left out)."""
    return tuple(tuple(s for layer, s in zip(st.layers, st.strategies)
                       if layer not in ("embed", "head")) for st in plan.stages)


@dataclass(frozen=True)
class Priced:
    plan: Plan                 # the configuration as fxpar would run and predict it
    fits: bool                 # within the memory limit
    note: str = ""             # why it does not fit, or how it was priced

    @property
    def iteration_s(self) -> float:
        return self.plan.predicted.iteration_s


class Pricer:
    """One captured model on one cluster and GPU count: fxpar's best plans and the price of any
    configuration of the same request, sharing one capture."""

    def __init__(self, model, gpus: int, example_inputs=None, *, cluster=None,
                 global_batch: int | None = None, seq: int | None = None,
                 memory_limit: float | None = None, zero1: bool = False,
                 runtime: str | None = None, moe_imbalance: float | None = None):
        from planner.api import (_check_gpus, _memory_limit_bytes, _model_costs, default_cluster,
                                 with_runtime)
        self.gpus = _check_gpus(gpus)
        self.cluster = with_runtime(cluster or default_cluster(), runtime)
        self.limit = _memory_limit_bytes(memory_limit, self.cluster)
        self.costs, self.name, self.global_batch, self.seq = _model_costs(
            model, example_inputs, global_batch, seq, zero1, fp32=self.cluster.runtime_priced)
        # --zero1 fixes ZeRO-1 as `fxpar plan --zero1` does; otherwise the search picks the
        # level (a configuration states its own: Configuration.zero)
        self.zero = {"zero": 1} if zero1 else {}
        self.imbalance = moe_imbalance  # --moe-imbalance, for plans and priced configurations
        # ep -> its EPPricing, kept: ModelCosts caches block prices per pricing instance
        self._pricings: dict = {}

    def request(self, fix: dict | None = None, top_k: int = 1,
                memory_limit: float | None = None, schedules: tuple | None = None) -> Request:
        req = Request(self.gpus, self.cluster, self.global_batch, self.seq,
                      self.limit if memory_limit is None else memory_limit, self.name,
                      {**self.zero, **(fix or {})}, top_k=top_k)
        return req if schedules is None else replace(req, schedules=schedules)

    def best(self, top_k: int = 1, fix: dict | None = None,
             schedules: tuple | None = None) -> list[Plan]:
        """fxpar's own plans, fastest first (as planner.api.plan, with `fix` as --fix), among
        `schedules` ((name, v) pairs) when given, else every schedule."""
        from planner.api import _infeasible
        check_fix(dict(fix or {}))
        req = self.request(fix, top_k=top_k, schedules=schedules)
        plans = self._search(req)
        if not plans:
            raise _infeasible(self.costs, req)
        return plans

    def price(self, config: Configuration) -> Priced:
        fix = config.fix()
        check_fix(fix)
        if config.stages is None and config.ends == "auto":
            return self._searched({**fix, "ep": config.ep})
        with self._experts(config.ep):
            priced = self._given(config, fix)
        return replace(priced, plan=replace(priced.plan, ep=config.ep))

    def _search(self, req: Request) -> list[Plan]:
        """fxpar's search over every EP size the request leaves open (a dense model: ep=1), as
        `fxpar plan` runs it (planner.api.plan_costs)."""
        return search_experts(self.costs, req, search, self.imbalance)

    @contextmanager
    def _experts(self, ep: int):
        """The model's MoE blocks priced at `ep` inside the block, as the search prices that
        size; an ep the experts do not divide is refused naming the legal ones."""
        ep_sizes(self.costs, self.gpus, ep)
        if ep not in self._pricings:
            self._pricings[ep] = ep_pricing(self.costs, ep, self.imbalance)
        set_ep(self.costs, ep, self._pricings[ep], self.cluster)
        try:
            yield
        finally:
            set_ep(self.costs, 1, None)

    def tp_sizes(self) -> list[int]:
        """The tensor-parallel sizes the search considers for this model and cluster."""
        return tp_sizes(self.costs, self.gpus, self.cluster)

    def vocab_split(self, tp: int) -> str | None:
        """None where the embedding and head split over the vocabulary at `tp` (as Megatron-LM
        and torchtitan split them), else why not."""
        if tp == 1 or all(self.costs._end_profile(k, tp) is not None for k in self.costs.ends):
            return None
        return self.costs.vocab_errors.get(tp, "see the vocabulary-parallel rewrite")

    def _refusal(self, fix: dict) -> ValueError:
        """Why nothing plans for `fix`, at its ep (else the ep `costs` is priced at)."""
        from planner.api import _infeasible
        loose = {k: v for k, v in fix.items() if k != "ep"}
        with self._experts(fix.get("ep", self.costs.ep)):
            return _infeasible(self.costs, self.request(loose, memory_limit=math.inf))

    def _searched(self, fix: dict) -> Priced:
        plans = self._search(self.request(fix))
        if plans:
            return Priced(plans[0], True, "fxpar placed the blocks (as --fix " +
                          ",".join(f"{k}={v}" for k, v in fix.items()
                                   if k != "ep" or v > 1) + ")")
        plans = self._search(self.request(fix, memory_limit=math.inf))
        if not plans:
            raise self._refusal(fix)
        plan = replace(plans[0], memory_limit_bytes=self.limit)
        return Priced(plan, False, self._too_big(plan))

    def _too_big(self, plan: Plan) -> str:
        return (f"does not fit: needs {gib(plan.predicted.peak_memory_bytes, up=True)} GiB per "
                f"device, the limit is {gib(self.limit)} GiB")

    def _given(self, config: Configuration, fix: dict) -> Priced:
        """The stated layout at the EP size `costs` is priced at (Pricer._experts)."""
        costs = self.costs
        # (ep is not a filter of the configurations: costs.ep is, as the search sets it)
        loose = {k: v for k, v in fix.items() if k not in ("strategy", "ep")}
        req = self.request(loose)
        found = next(configurations(costs, req), None)
        if found is None:
            why = why_nothing_plans(costs, req)
            raise ValueError(why) if why else self._refusal(loose)
        cand = replace(found, lower_bound=0.0)
        stages = config.stages
        if stages is None:  # every block the one strategy, split as evenly as whole blocks allow
            stages = even_stages(costs.num_blocks, cand.pp * cand.v, config.strategy or "none")
        if len(stages) != cand.pp * cand.v:
            raise ValueError(f"the layout has {len(stages)} stages; pp={cand.pp} with v={cand.v} "
                             f"stages per rank needs {cand.pp * cand.v}")
        if sum(map(len, stages)) != costs.num_blocks:
            raise ValueError(f"the layout places {sum(map(len, stages))} blocks; the model has "
                             f"{costs.num_blocks}")
        names = sorted({s for stage in stages for s in stage})
        strategies = [Strategy.parse(n) for n in names]
        if cand.tp > 1 and not any(s.tp for s in strategies):
            raise ValueError(f"no block uses tensor parallelism, but tp={cand.tp}")
        if cand.tp == 1 and any(s.tp for s in strategies):
            raise ValueError("blocks use tensor parallelism, but tp=1")
        if any(s.sp for s in strategies) and not costs.supports_sp(cand.tp, cand.cp, req.seq):
            why = costs.sp_error(cand.tp)
            raise ValueError("sequence parallel does not apply: " + (
                f"the blocks' sequence-parallel rewrite stops: {why}" if why else
                f"each rank's {req.seq // cand.cp} positions do not split over tp={cand.tp} "
                f"ranks"))
        problem, blocks, counts = _layout_problem(costs, req, cand, names, stages,
                                                  self._ends(config.ends, cand))
        parts = ilp.breakdown(problem, counts)
        solution = ilp.Solution(counts, parts.iteration_s, "given", 0.0, 0.0)
        plan = make_plan(costs, req, cand, problem, blocks, solution)
        plan = replace(plan, solver="", timing={}, stages=tuple(
            replace(st, strategies=tuple(self._end_label(config.ends, cand) if layer in
                                         ("embed", "head") else s
                                         for layer, s in zip(st.layers, st.strategies)))
            for st in plan.stages) if config.ends != "auto" else plan.stages)
        if plan.predicted.peak_memory_bytes > self.limit:
            return Priced(plan, False, self._too_big(plan))
        return Priced(plan, True, "priced as given")

    def _ends(self, ends: str, cand):
        costs, mb, cp, tp = self.costs, cand.micro_batch, cand.cp, cand.tp
        if ends == "auto":
            return costs.end_costs(mb, self.cluster, padded=True, cp=cp, tp=tp)
        if ends == "vocab-tp" and tp > 1:
            if any(costs._end_profile(k, tp) is None for k in costs.ends):
                raise ValueError(f"the embedding and head cannot be split over the vocabulary at "
                                 f"tp={tp} ({costs.vocab_errors.get(tp, 'see the rewrite')}); "
                                 f"Megatron-LM and torchtitan always split them, so fxpar "
                                 f"cannot price their configuration of this model at tp={tp}")
            return list(costs._vocab_ends(mb, self.cluster, cp, tp))
        return list(costs._ends_priced(mb, self.cluster, cp))

    @staticmethod
    def _end_label(ends: str, cand) -> str:
        return "vocab-tp" if ends == "vocab-tp" and cand.tp > 1 else "none"


def _layout_problem(costs, req, cand, names, stages, ends):
    """The stage problem of a stated layout, its LayerCosts and per-stage option counts. Blocks
    of several kinds (planner.search.costs runs) get one option per (run, strategy), each priced for
    its own kind, so that the counts say which blocks a stage holds."""
    runs = costs.runs if len(costs.runs) > 1 else ((0, costs.num_blocks),)
    priced = {(k, n): costs.price_block(Strategy.parse(n), cand.micro_batch, req.cluster,
                                        cand.tp, cand.cp, k) for k, _ in runs for n in names}
    blocks = [priced[k, n] for k, _ in runs for n in names]
    sharding = zero_axis.sharding_of(cand)  # the ZeRO level's shares, as the search prices
    option = [tuple(runtime_terms(costs.block_option(priced[k, n], sharding), priced[k, n], req,
                                  cand, costs) for n in names) for k, _ in runs]
    run_of = []
    for j, (_, count) in enumerate(runs):
        run_of += [j] * count
    counts, position = [], 0
    for stage in stages:
        row = [0] * (len(runs) * len(names))
        for name in stage:
            row[run_of[position] * len(names) + names.index(name)] += 1
            position += 1
        counts.append(tuple(row))
    block_runs = (tuple(ilp.BlockRun(costs.kinds[k].name, count, option[j])
                        for j, (k, count) in enumerate(runs)) if len(runs) > 1 else ())
    problem = stage_problem(costs, req, cand, option[0] if not block_runs else (), ends,
                            math.inf, block_runs, blocks)
    return problem, blocks, tuple(counts)


def even_stages(blocks: int, stages: int, strategy: str) -> tuple[tuple[str, ...], ...]:
    """Blocks split as evenly as whole blocks allow, the first stages taking the remainder."""
    return tuple((strategy,) * (blocks // stages + (1 if s < blocks % stages else 0))
                 for s in range(stages))


def compare(ours: Plan, theirs: Priced, label: str) -> str:
    """"fxpar plan: X s/iteration; <label>: Y s/iteration (+d%); memory per device ..."."""
    from planner.report.explain import percent
    a, b = ours.predicted, theirs.plan.predicted
    fits = "" if theirs.fits else f" ({theirs.note})"
    return (f"fxpar plan: {a.iteration_s:.4g} s/iteration; {label}: {b.iteration_s:.4g} "
            f"s/iteration ({percent(a.iteration_s, b.iteration_s)}); memory per device {gib(a.peak_memory_bytes)} GiB "
            f"vs {gib(b.peak_memory_bytes)} GiB{fits}")
