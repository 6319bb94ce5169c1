"""The fitted terms of the runtime profiles, set from published runs (`fxpar validate --fit`),
and their check on runs they were not fitted to (`fxpar validate --cross-validate`).

A hardware profile holds datasheet and microbenchmark numbers and is never fitted. A runtime
profile (cost_model.hardware.runtimes) has two fitted terms, shared by the runtimes of one
family (runtimes.FAMILY): compute_share, the share of the microbenchmarked tensor-core rates a
training step keeps, and host_op_s, the host's time per kernel launch. A family's fit uses
the priced rows of its runtimes only.

The objective is the mean |ln(predicted / published)| over those rows: a row predicted 2x slow
weighs what one 2x fast does, and one wild row does not pull the others as a squared error
would. A step time is a sum of maxima (rooflines, launch floors, overlaps) and has kinks, so the
search needs no gradient: a Nelder-Mead simplex inside the terms' ranges (`EVALUATIONS`).
Each row's model is captured once (planner.bench.published.model_costs); an evaluation only
prices the fixed configurations again.

Cross-validation leaves one source (one CSV file) out at a time: every family is fitted on the
other sources' rows, and the left-out source's rows are priced with those fits; a family with
fewer rows left than MIN_ROWS keeps its priors (runtimes.PRIORS): two constants fitted on one
or two rows would be set by those rows alone. The table of those errors is the model's error
on runs it was not fitted to.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from cost_model.hardware.runtimes import FAMILY, FITTED, PRIORS, with_fitted
from planner.bench.published import Result, Row, load_models, price

RANGES = {"compute_share": (0.40, 1.00), "host_op_s": (0.0, 40e-6)}
MIN_ROWS = len(FITTED) + 1   # a family's terms are fitted on more rows than there are terms
EVALUATIONS = 30


@dataclass(frozen=True)
class Fit:
    """One family's fit: its terms before (the priors) and after, and the objective."""
    family: str
    rows: int
    before: tuple[float, float]
    after: tuple[float, float]
    loss_before: float          # mean |ln(predicted / published)|
    loss_after: float


def loss(results: list[Result]) -> float:
    priced = [r for r in results if r.priced]
    return sum(abs(math.log(r.predicted_s / r.row.step_s)) for r in priced) / len(priced)


def family_runtimes(family: str, terms: tuple[float, float]) -> dict:
    """{runtime name: Runtime} of the family with its fitted terms."""
    return {n: with_fitted(PRIORS[n], *terms) for n, f in FAMILY.items() if f == family}


def fit_family(family: str, rows: list[Row], specs: dict | None = None) -> Fit:
    """The fit of `family`'s terms on `rows` (those of its runtimes that price)."""
    specs = load_models() if specs is None else specs
    prior = (PRIORS[_member(family)].compute_share, _eager_host(family, PRIORS))

    def objective(terms) -> float:
        runtimes = family_runtimes(family, tuple(terms))
        return loss([price(r, specs.get(r.model), r.cluster, runtimes) for r in rows])

    best = _simplex(objective, list(prior), [RANGES[n] for n in FITTED])
    after = (round(best[0], 3), round(best[1], 7))
    return Fit(family, len(rows), prior, after, objective(prior), objective(after))


def _member(family: str) -> str:
    return next(n for n, f in FAMILY.items() if f == family)


def _eager_host(family: str, runtimes: dict) -> float:
    """The family's launch time as an eager runtime's (runtimes.with_fitted's scale)."""
    name = _member(family)
    return runtimes[name].host_op_s * PRIORS["fxpar"].host_op_s / PRIORS[name].host_op_s


def fit_all(rows: list[Row], specs: dict | None = None,
            progress: Callable[[str], None] | None = None) -> tuple[dict, list[Fit]]:
    """({runtime name: fitted Runtime}, the fits) over every family with MIN_ROWS priced rows;
    the other families keep their priors."""
    specs = load_models() if specs is None else specs
    runtimes, fits = dict(PRIORS), []
    for family in dict.fromkeys(FAMILY.values()):
        mine = [r for r in rows if FAMILY[r.runtime] == family and _prices(r, specs)]
        if len(mine) < MIN_ROWS:
            continue
        fit = fit_family(family, mine, specs)
        runtimes |= family_runtimes(family, fit.after)
        fits.append(fit)
        if progress:
            progress(fit_text(fit))
    return runtimes, fits


def _prices(row: Row, specs: dict) -> bool:
    return price(row, specs.get(row.model), row.cluster).priced


def fit_text(fit: Fit) -> str:
    (c0, h0), (c1, h1) = fit.before, fit.after
    return (f"fit of the {fit.family} family on its {fit.rows} priced rows: compute_share "
            f"{c0:.3f} -> {c1:.3f}, host_op_s {h0 * 1e6:.1f} -> {h1 * 1e6:.1f} us; mean "
            f"|ln(predicted/published)| {fit.loss_before:.3f} -> {fit.loss_after:.3f}")


@dataclass(frozen=True)
class Fold:
    """One source left out: the fits made without it and its rows priced with them."""
    source: str
    fits: tuple[Fit, ...]
    results: tuple[Result, ...]


def cross_validate(rows: list[Row], specs: dict | None = None,
                   progress: Callable[[str], None] | None = None, base=None) -> list[Fold]:
    """Leave-one-source-out (module doc): one Fold per source (CSV file) with a priced row.
    `base`: fit_all's result on every row, when already made. A family none of whose rows the
    source holds is fitted on the same rows either way, so only the source's own families are
    fitted again. (One process: HiGHS's thread pool does not survive a fork.)"""
    specs = load_models() if specs is None else specs
    runtimes, fits = base or fit_all(rows, specs)
    sources = [s for s in dict.fromkeys(r.source for r in rows)
               if any(_prices(r, specs) for r in rows if r.source == s)]
    folds = []
    for source in sources:
        folds.append(_fold(source, rows, specs, runtimes, fits))
        if progress:
            progress(f"left out {source}: median |error| {median_error(folds[-1].results):.1f}%")
    return folds


def _fold(source: str, rows: list[Row], specs: dict, runtimes: dict, fits: list[Fit]) -> Fold:
    held = [r for r in rows if r.source == source]
    families = {FAMILY[r.runtime] for r in held}
    runtimes, kept = dict(runtimes), [f for f in fits if f.family not in families]
    for family in families:
        runtimes |= family_runtimes(family, (PRIORS[_member(family)].compute_share,
                                             _eager_host(family, PRIORS)))
        mine = [r for r in rows if r.source != source and FAMILY[r.runtime] == family
                and _prices(r, specs)]
        if len(mine) >= MIN_ROWS:   # else the family keeps its priors
            fit = fit_family(family, mine, specs)
            runtimes |= family_runtimes(family, fit.after)
            kept.append(fit)
    results = tuple(price(r, specs.get(r.model), r.cluster, runtimes) for r in held)
    return Fold(source, tuple(kept), results)


def median_error(results) -> float:
    errors = [abs(r.error_pct) for r in results if r.priced]
    return statistics.median(errors) if errors else math.nan


def _simplex(f: Callable[[list], float], start: list, bounds: list,
             evaluations: int = EVALUATIONS) -> list:
    """The least point Nelder-Mead finds within `evaluations` calls of f, every point clipped to
    its bounds; the first simplex steps a quarter of each range from `start`, into the range."""
    clip = lambda x: [min(max(v, lo), hi) for v, (lo, hi) in zip(x, bounds)]  # noqa: E731
    start = clip(start)
    # a step into the range (down from an upper bound): a step clipped back would leave the
    # simplex flat
    steps = [0.25 * (hi - lo) * (1 if v + 0.25 * (hi - lo) <= hi else -1)
             for v, (lo, hi) in zip(start, bounds)]
    points = [start] + [[v + (steps[j] if i == j else 0.0) for j, v in enumerate(start)]
                        for i in range(len(start))]
    scored = [(f(p), p) for p in points]
    calls = len(scored)
    while calls < evaluations:
        scored.sort(key=lambda s: s[0])
        (best, _), (second, _), (worst, far) = scored[0], scored[-2], scored[-1]
        centre = [sum(p[i] for _, p in scored[:-1]) / (len(scored) - 1)
                  for i in range(len(start))]
        along = lambda t: clip([c + t * (c - w) for c, w in zip(centre, far)])  # noqa: E731
        tried = [along(1.0)]
        value = f(tried[0])
        calls += 1
        if value < best:                       # reflect, then try expanding
            wider = along(2.0)
            wide = f(wider)
            calls += 1
            scored[-1] = (wide, wider) if wide < value else (value, tried[0])
        elif value < second:
            scored[-1] = (value, tried[0])
        else:                                  # contract towards the centre, else shrink
            inner = along(-0.5)
            near = f(inner)
            calls += 1
            if near < worst:
                scored[-1] = (near, inner)
            else:
                low = scored[0][1]
                scored = [scored[0]] + [(f(q), q) for q in
                                        (clip([(a + b) / 2 for a, b in zip(low, p)])
                                         for _, p in scored[1:])]
                calls += len(scored) - 1
    return min(scored, key=lambda s: s[0])[1]


__all__ = ["Fit", "Fold", "RANGES", "cross_validate", "fit_all", "fit_family",
           "fit_text", "loss", "median_error"]
