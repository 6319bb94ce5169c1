"""A few named efficiency constants of a cluster profile fitted on the published runs that ran on
it (`fxpar validate --fit matmul_eff,attention_eff`).

Everything else in the cost model comes from hardware facts (cost_model.hardware.cluster's
presets); what no datasheet gives — the share of the tensor cores' peak that long GEMMs keep
under a power limit, what the attention kernels reach — may be fitted here, per profile, on the
rows of planner/bench/published whose file names that profile. Each row is captured once
(planner.bench.published.model_costs); a fit only searches again with the changed constants.

The objective is the mean |ln(predicted / published)| over the profile's priced rows: a row
predicted 2x slow weighs what one 2x fast does, and one wild row does not pull the others as a
squared error would. A step time is a sum of maxima (rooflines, overlaps) and has kinks, so the
searches need no gradient: one constant by golden-section search over its range; several
together by a Nelder-Mead simplex inside their ranges (`SIMPLEX_EVALUATIONS`), because they
trade against each other along valleys (a lower matmul_eff and a higher grouped_gemm_eff price
a MoE row alike) where searching one constant at a time stops early.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from planner.bench.published import Result, Row, load_models, price

# Constants a fit may change, and the range searched (what a GPU of the presets can reach)
RANGES = {
    "matmul_eff": (0.30, 0.90),
    "attention_eff": (0.20, 0.80),
    "grouped_gemm_eff": (0.40, 1.00),
    "bw_eff": (0.50, 0.95),
    "comm_eff": (0.40, 1.00),
}
STEPS = 10       # golden-section steps: the range shrinks to 0.8%
SIMPLEX_EVALUATIONS = 90
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class Fit:
    """One profile's fit: the constants before and after, and the objective at each."""
    cluster: str
    rows: int
    before: tuple[tuple[str, float], ...]
    after: tuple[tuple[str, float], ...]
    loss_before: float          # mean |ln(predicted / published)|
    loss_after: float
    evaluations: int


def parse_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RANGES]
    if not names or unknown:
        raise ValueError(f"--fit takes a comma-separated list of {', '.join(RANGES)}; got "
                         f"{text!r}")
    return names


def loss(results: list[Result]) -> float:
    priced = [r for r in results if r.priced]
    return sum(abs(math.log(r.predicted_s / r.row.step_s)) for r in priced) / len(priced)


def fit_cluster(rows: list[Row], cluster, names: tuple[str, ...],
                progress: Callable[[str], None] | None = None,
                specs: dict | None = None) -> tuple[Fit, object]:
    """(the fit, the fitted Cluster) of `cluster` on `rows` (those priced on it); specs: how to
    build each row's model (default planner/bench/published/models.json)."""
    from cost_model.hardware.cluster import get_cluster
    base = get_cluster(cluster)
    specs = load_models() if specs is None else specs
    priceable = [r for r in rows if price(r, specs.get(r.model), base).priced]
    if not priceable:
        raise ValueError(f"no row on {base.name} could be priced: nothing to fit")
    calls = [0]

    def objective(values: dict) -> float:
        calls[0] += 1
        hw = dataclasses.replace(base, **values)
        return loss([price(r, specs.get(r.model), hw) for r in priceable])

    values = {n: getattr(base, n) for n in names}
    start = objective(values)
    if len(names) == 1:
        (name,) = names
        values[name] = _golden(lambda x: objective({name: x}), *RANGES[name])
    else:
        best = _simplex(lambda xs: objective(dict(zip(names, xs))), list(values.values()),
                        [RANGES[n] for n in names])
        values = {n: round(x, 3) for n, x in zip(names, best)}
    if progress:
        progress(f"{base.name}: " + ", ".join(f"{n} = {v:.3f}" for n, v in values.items()))
    fitted = dataclasses.replace(base, **values)
    fit = Fit(base.name, len(priceable), tuple((n, getattr(base, n)) for n in names),
              tuple(values.items()), start, objective(values), calls[0])
    return fit, fitted


def _golden(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The minimum of f over [lo, hi] after STEPS golden-section steps (the midpoint of the last
    bracket, rounded to 3 decimals as the profiles print it)."""
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(STEPS):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return round((a + b) / 2, 3)


def _simplex(f: Callable[[list], float], start: list, bounds: list,
             evaluations: int = SIMPLEX_EVALUATIONS) -> list:
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


def fit_text(fit: Fit) -> str:
    changes = ", ".join(f"{n} {b:.3f} -> {a:.3f}" for (n, b), (_, a) in zip(fit.before,
                                                                            fit.after))
    return (f"fit of {fit.cluster} on its {fit.rows} priced rows: {changes}; mean |ln(predicted/"
            f"published)| {fit.loss_before:.3f} -> {fit.loss_after:.3f} "
            f"({fit.evaluations} evaluations)")
