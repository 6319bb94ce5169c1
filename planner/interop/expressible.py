"""The fastest configuration a framework can state, for `fxpar plan --emit`.

Converting fxpar's plan alone to its nearest configuration can leave a framework a layout much
slower than the best it can run (ZeRO-1 on a mesh chosen for it, turned into FSDP for torchtitan).
So where fxpar's plan uses what the target cannot state on an axis the search can restrict, the
search runs again among the layouts the target states:

* torchtitan: data parallel replicated or FSDP (zero 0 or 3), never ZeRO-1 or 2; no more
  pipeline stages than transformer layers (its split points name each stage's first);
* Megatron-LM: the 1F1B and interleaved schedules only, no hybrid sharding (zero 0, 1, 2, or 3
  over all data-parallel ranks of fxpar's mesh);
* both: a pipeline schedule only with a pipeline, and the embedding and head split over the
  vocabulary at tp > 1, so only tp sizes at which this model's ends can be split; expert
  parallelism only as the target states it (planner.interop.expert_layout: no tp beside it,
  and for torchtitan all of cp within it), so without ep, or without tp (and cp).

Other fixed settings (--fix) are kept. Every plan found, and the nearest of fxpar's own, is
converted to the target's nearest configuration (planner.interop.emit.nearest) and priced; the
fastest that fits is emitted, its header comparing it with fxpar's unrestricted plan."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from cost_model.layers.strategy import Strategy
from planner.interop.configuration import Priced
from planner.interop.emit import (MEGATRON_SCHEDULES, TARGETS, Expressed, layout_text,
                                  nearest)
from planner.interop.expert_layout import Unstated, restricted, unstated
from planner.search.plan import Plan

MEGATRON_SEARCH = (("1f1b", 1), ("interleaved-1f1b", 2))


@dataclass
class Restriction:
    fixes: list[dict]                   # the searches to run, each a --fix
    schedules: tuple | None = None      # the (schedule, v) pairs they plan among
    why: str = ""                       # what was restricted, for the header


def restriction(target: str, plan: Plan, fix: dict, pricer) -> Restriction | None:
    """The searches among the target's layouts, or None where fxpar's plan uses nothing the
    target cannot state on an axis the search restricts."""
    base, why, axes, schedules = dict(fix), [], {}, None
    if pricer.vocab_split(plan.tp) is not None:
        sizes = [t for t in pricer.tp_sizes() if pricer.vocab_split(t) is None]
        axes["tp"] = [{"tp": t} for t in sizes]
        why.append(f"tp {' or '.join(map(str, sizes))}, where the model's embedding and head "
                   f"split over the vocabulary")
    if unstated(target, plan.tp, plan.cp, plan.ep):
        axes["ep"] = restricted(target)
        why.append("expert parallelism without tp" + (" or cp" if target == "torchtitan" else "")
                   + ", or none")
    blocks = pricer.costs.num_blocks
    if target == "torchtitan" and plan.pp * plan.virtual_stages > blocks:
        axes["pp"] = [{"pp": p, "v": 1} for p in range(1, blocks + 1) if plan.gpus % p == 0]
        why.append(f"at most {blocks} pipeline stages, one per transformer layer at least "
                   f"(a split point names a stage's first)")
    if target == "torchtitan" and plan.dp * plan.cp > 1 and (
            plan.zero in (1, 2) or (plan.zero == 0 and plan.cp > 1)):
        axes["zero"] = [{"zero": 0}, {"zero": 3}]
        why.append("zero 0 or 3: replicas or FSDP")
    if target == "megatron" and plan.dp_shard and plan.dp_shard != plan.dp:
        axes["zero"] = [{"zero": z} for z in (0, 1, 2)] + [
            {"zero": 3, "dp": plan.dp, "dp_shard": plan.dp}]
        why.append(f"no hybrid sharding: zero 0, 1, 2, or 3 over all dp={plan.dp}")
    if target == "megatron" and plan.schedule not in MEGATRON_SCHEDULES:
        schedules = MEGATRON_SEARCH
        why.append("schedules 1f1b and interleaved-1f1b")
    elif plan.pp == 1 and plan.schedule != "1f1b":  # a split backward without a pipeline
        schedules = MEGATRON_SEARCH if target == "megatron" else None
        why.append("a schedule only with a pipeline")
        for key in ("schedule", "split_backward"):
            base.pop(key, None)
    if not why:
        return None
    if schedules is not None:
        for key in ("schedule", "split_backward"):
            base.pop(key, None)
    if "zero" in axes:
        base.pop("dp_shard", None)
    fixes = [_merged(base, parts) for parts in itertools.product(*axes.values())]
    unique = [f for i, f in enumerate(fixes) if f is not None and f not in fixes[:i]]
    return Restriction(unique, schedules, "; ".join(why))


def _merged(base: dict, parts) -> dict | None:
    """`base` with the restricted settings; a fixed strategy keeps its recomputation where the
    restriction leaves no tensor parallelism for it."""
    fix = dict(base)
    for part in parts:
        fix.update(part)
    if "strategy" in fix and fix.get("tp") == 1:
        fix["strategy"] = str(Strategy(recompute=Strategy.parse(fix["strategy"]).recompute))
    if "dp_shard" in fix and fix.get("zero") == 0:
        return None
    return fix


@dataclass
class Option:
    plan: Plan
    expressed: Expressed

    @property
    def priced(self) -> Priced:
        return self.expressed.priced or Priced(self.plan, True, "planned")

    def key(self):
        p = self.priced
        return (not p.fits, p.iteration_s if p.fits else p.plan.predicted.peak_memory_bytes)


def fastest_expressible(target: str, plan: Plan, pricer, fix: dict) -> Expressed:
    """The configuration to emit for fxpar's `plan`: its nearest, or where the target cannot
    state it, the fastest of the layouts the target states (Expressed.planned: the plan
    found)."""
    label = TARGETS[target]
    notes, own = [], None
    try:
        own = nearest(target, plan, lambda: pricer)
        notes = list(own.notes)
    except Unstated as err:  # the plan's expert parallelism: planned among what the target states
        notes.append(str(err))
    except ValueError:
        why = pricer.vocab_split(plan.tp)
        if why is None:
            raise
        notes.append(f"{label} splits the embedding and head over the vocabulary at tp > 1, "
                     f"which fxpar keeps whole at tp={plan.tp}: this model's cannot be split "
                     f"there ({why})")
    limits = restriction(target, plan, fix, pricer)
    if limits is None:
        if own is None:
            raise ValueError(notes[-1])
        return own
    options = [Option(plan, own)] if own is not None else []
    for restricted in limits.fixes:
        found = _planned(target, pricer, restricted, limits.schedules)
        if found is not None:
            options.append(found)
    if not options:
        raise ValueError(f"--emit {target}: no layout {label} can state plans ({limits.why}); "
                         + notes[-1])
    best = min(options, key=Option.key)
    if best.expressed is own:
        return own
    converted = (f"; fxpar's plan converted prices at {own.priced.iteration_s:.4g} s/iteration"
                 if own is not None and own.priced is not None else "")
    said = [f"nearest: the fastest of the layouts {label} can state ({limits.why}), planned: "
            f"{layout_text(best.plan)}{converted}"]
    said += [n for n in best.expressed.notes if n not in notes]
    # what the plan uses that the target cannot state, without the conversion's own nearest:
    # the planned layout is the one nearest, said once
    why = [n.split("; nearest:")[0] for n in notes if not n.startswith("nearest")]
    return Expressed(best.expressed.config, why + said, best.expressed.pattern, best.priced,
                     planned=best.plan)


def _planned(target: str, pricer, fix: dict, schedules) -> Option | None:
    """The fastest plan of one restricted search, as the target's nearest configuration."""
    try:
        plan = pricer.best(fix=fix, schedules=schedules)[0]
        return Option(plan, nearest(target, plan, lambda: pricer))
    except ValueError:  # nothing plans under this restriction, or the target cannot state it
        return None
