"""A rank's peak-memory forms in the stage ILP's terms (planner.search.ilp, "Memory"): which
activation sets, gradients and buffers can be alive together at the moments a rank could peak.
The ILP makes each form a row; a plan reports the largest (planner.search.solved)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankParts:
    """Rank r's memory terms for a block assignment: static bytes (weights, gradients and
    optimizer states), the gradients among them, each of its stages' activations of one
    micro-batch, the moments' activation-set counts per stage, X_r and whether its gradients
    are lazy; `peaks` are the forms whose largest is its peak (module docstring, "Memory")."""
    static: float
    grads: float
    lazy_grads: float
    acts: tuple[float, ...]
    moments: tuple[tuple[float, ...], ...]
    temp: float
    lazy: bool
    steps: float
    zero: tuple[float, float] = (0.0, 0.0)   # (in use, whole): StageProblem.zero_*
    step_share: float = 0.0                  # StageProblem.step_share
    records: tuple[float, ...] = ()          # per stage, one micro-batch's recorded gradients
    split_w: bool = False                    # StageProblem.split_w, on a rank past the first

    def forms(self) -> list[tuple[float, tuple[float, ...], tuple[float, ...], float, float]]:
        """rank_forms, and with a step share the optimizer step's: every gradient, no
        activation set, the step's fp32 gradient copies beside them."""
        forms = rank_forms(self.moments, self.lazy, *self.zero, stages=len(self.acts),
                           split_w=self.split_w)
        if self.step_share:
            none = (0.0,) * len(self.acts)
            forms.append((0.0, none, none, self.static * self.step_share, 1.0))
        return forms

    def peaks(self) -> list[float]:
        records = self.records or (0.0,) * len(self.acts)
        return [self.static + g * self.lazy_grads
                + sum(f * a for f, a in zip(factors, self.acts))
                + sum(f * b for f, b in zip(kept, records)) + t * self.temp + extra
                for g, factors, kept, extra, t in self.forms()]


def rank_forms(moments, lazy: bool, in_use: float = 0.0, whole: float = 0.0, stages: int = 0,
               split_w: bool = False
               ) -> list[tuple[float, tuple[float, ...], tuple[float, ...], float, float]]:
    """The peak-memory forms of a rank's `stages` local stages as (coefficient of its lazy
    gradients, per stage the coefficient of one micro-batch's activations, per stage that of
    its recorded gradients, bytes beside them, coefficient of the rank's largest temporary
    X_r): one per moment (a moment longer than `stages` carries the record counts after the
    activation counts, runtime.pipeline.generators.inflight_moments); with lazy gradients two,
    those absent, or present with one set of the stage backwarded first (its last) freed; under
    ZeRO 2-3 each twice again, with the unit in use, or with the whole transient and one set of
    every stage freed. With `split_w` (a ZB-H1 rank past the first) the gradients come in W,
    which frees its set only once it returns: the second form keeps every set, and the
    temporaries of the backward before it (I's, X_r) are gone by then."""
    forms = []
    for mo in moments:
        acts, kept = tuple(mo[:stages or len(mo)]), tuple(mo[stages or len(mo):])
        kept = kept or (0.0,) * len(acts)
        if not lazy:
            forms.append((0.0, acts, kept, 1.0))
            continue
        last = len(acts) - 1
        forms.append((-1.0, acts, kept, 1.0))
        if split_w:
            forms.append((0.0, acts, kept, 0.0))
        else:
            forms.append((0.0, tuple(f - min(f, 1.0) * (c == last) for c, f in enumerate(acts)),
                          kept, 1.0))
    if not whole:
        return [(g, factors, kept, in_use, t) for g, factors, kept, t in forms]
    return [form for g, factors, kept, t in forms for form in
            ((g, factors, kept, in_use, t),
             (g, tuple(max(f - 1.0, 0.0) for f in factors), kept, whole, t))]


def rank_moments(problem, r: int) -> tuple[tuple[float, ...], ...]:
    """The activation-set counts per local stage at rank r's candidate peaks: the schedule's
    (runtime.pipeline.generators.inflight_moments), or φ_r on every stage."""
    if problem.moments:
        return problem.moments[r]
    v = problem.stages // problem.ranks
    return ((problem.act_factor[r],) * v,)


def rank_parts(problem, counts, r: int) -> RankParts:
    static, grads, lazy_grads, acts, steps, records = 0.0, 0.0, 0.0, [], 0.0, []
    for s in problem.stages_of(r):
        layers = [(c, o) for c, o in zip(counts[s], problem.options)]
        layers += [(1, e) for e in stage_ends(problem, s)]
        static += sum(c * o.static_bytes for c, o in layers)
        grads += sum(c * o.grad_bytes for c, o in layers)
        lazy_grads += sum(c * o.lazy_grad_bytes for c, o in layers)
        acts.append(sum(c * o.act_bytes for c, o in layers))
        records.append(sum(c * o.record_bytes for c, o in layers))
        steps += sum(c * o.step_s for c, o in layers)
    temp = problem.rank_temp[r] if problem.rank_temp else 0.0
    lazy = bool(problem.lazy_grads) and problem.lazy_grads[r] and lazy_grads > 0
    return RankParts(static, grads, lazy_grads, tuple(acts), rank_moments(problem, r), temp,
                     lazy, steps, (problem.zero_in_use, problem.zero_whole),
                     problem.step_share, tuple(records), problem.split_w and r > 0)


def stage_ends(problem, s: int) -> list:
    """The end layers (ilp.EndLayer) stage s holds: the embedding on the first, the head on the
    last."""
    return ([problem.embed] if s == 0 else []) + ([problem.head] if s == problem.stages - 1 else [])
