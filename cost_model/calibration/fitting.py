"""Least-squares fits that turn calibration's timings into cluster profile fields.

Every fit is the same two-term model, seconds = steps * alpha + volume / bw,
fitted in log space by `fit_alpha_beta`: timings span orders of magnitude
and their noise is multiplicative, so a plain least-squares fit would let
the largest timings decide everything. It is used for
- the links (`fit_links`): alpha and bw per link class (intra- or
  inter-node, classed by the rule comm.collective_time uses) and, per
  collective kind other than all_reduce, the latency/bandwidth multipliers
  that its own timings want;
- compute (`fit_matmul`): the Linear rate and the per-call overhead that
  makes small GEMMs run below it.

No measuring here (calibrate.py and the bench_* modules do that), so the
fits can be checked on synthetic timings.
"""

from __future__ import annotations

import math
from typing import Sequence

from cost_model.hardware.cluster import Cluster
from cost_model.hardware.comm import KINDS, collective_terms

__all__ = ["fit_alpha_beta", "fit_links", "fit_matmul"]


# --------------------------------------------------------------------------
# Two-term fit in log space
# --------------------------------------------------------------------------
def fit_alpha_beta(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Fit  seconds = steps * alpha + volume / bw  to (steps, volume, seconds)
    samples; returns (alpha, bw).

    The fit minimises squared *log* errors: timings span orders of
    magnitude and noise is multiplicative, so a plain least-squares fit
    would let the largest messages decide everything and mispredict small
    ones many times over. A linear fit of relative residuals gives the
    starting point; Levenberg-Marquardt in log-parameters (which keeps
    alpha and bw positive) refines it.
    """
    rows = [(s, v, t) for s, v, t in samples if t > 0 and s + v > 0]
    if len(rows) < 2:
        raise ValueError("need at least two timings with positive duration to fit alpha and bw")
    alpha, inv_bw = _fit_relative_linear(rows)
    x, y = _refine_log(rows, math.log(max(alpha, _TINY_ALPHA)), math.log(inv_bw))
    return math.exp(x), 1.0 / math.exp(y)


_TINY_ALPHA = 1e-12  # seconds; "no measurable latency"


def _fit_relative_linear(rows) -> tuple[float, float]:
    """Least squares of (steps*alpha + volume*inv_bw) / t - 1, clamped >= 0."""
    ab = [(s / t, v / t) for s, v, t in rows]
    saa = sum(a * a for a, _ in ab)
    sbb = sum(b * b for _, b in ab)
    sab = sum(a * b for a, b in ab)
    sa, sb = sum(a for a, _ in ab), sum(b for _, b in ab)
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        alpha, inv_bw = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
        if alpha >= 0 and inv_bw > 0:
            return alpha, inv_bw
    # Degenerate or a negative latency: fall back to a bandwidth-only start;
    # the log-space refinement brings alpha back if the data wants it.
    if sbb > 0 and sb > 0:
        return 0.0, sb / sbb
    raise ValueError("timings do not grow with message size; cannot fit a bandwidth")


def _log_cost(rows, x: float, y: float) -> float:
    ea, eb = math.exp(x), math.exp(y)
    return sum(math.log((s * ea + v * eb) / t) ** 2 for s, v, t in rows)


def _refine_log(rows, x: float, y: float, iters: int = 200) -> tuple[float, float]:
    """Levenberg-Marquardt on r_i = log(pred_i / t_i), parameters x = log alpha,
    y = log(1/bw)."""
    lam, cost = 1e-3, _log_cost(rows, x, y)
    for _ in range(iters):
        ea, eb = math.exp(x), math.exp(y)
        g0 = g1 = h00 = h01 = h11 = 0.0
        for s, v, t in rows:
            p = s * ea + v * eb
            r, j0, j1 = math.log(p / t), s * ea / p, v * eb / p
            g0, g1 = g0 + j0 * r, g1 + j1 * r
            h00, h01, h11 = h00 + j0 * j0, h01 + j0 * j1, h11 + j1 * j1
        a00, a11 = h00 * (1 + lam) + 1e-12, h11 * (1 + lam) + 1e-12
        det = a00 * a11 - h01 * h01
        dx, dy = (-g0 * a11 + g1 * h01) / det, (-g1 * a00 + g0 * h01) / det
        nx, ny = max(x + dx, math.log(_TINY_ALPHA)), y + dy
        new = _log_cost(rows, nx, ny)
        if new <= cost:
            converged = cost - new <= 1e-12 * max(cost, 1e-300)
            x, y, cost, lam = nx, ny, new, lam / 3
            if converged:
                break
        else:
            lam *= 4
    return x, y


# --------------------------------------------------------------------------
# Compute: Linear rate and per-call overhead
# --------------------------------------------------------------------------
# A Linear's forward + backward is priced as two matmul calls (forward and
# backward), each paying matmul_overhead once.
PRICED_CALLS_PER_LINEAR = 2


def fit_matmul(flops: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(rate, overhead) with  seconds = 2 * overhead + flops / rate  for the
    Linear fwd+bwd timings: the same two-term fit as a link's alpha and bw
    (fit_alpha_beta, in log space), here separating small GEMMs' lower rate
    from the large-GEMM rate. A single median rate priced small layers too
    fast and large ones too slow."""
    rows = [(PRICED_CALLS_PER_LINEAR, f, t) for f, t in zip(flops, seconds)]
    overhead, rate = fit_alpha_beta(rows)
    return rate, overhead


# --------------------------------------------------------------------------
# Links and per-kind corrections
# --------------------------------------------------------------------------
REFERENCE_KIND = "all_reduce"  # defines alpha and bw; other kinds are corrected relative to it


FIT_PASSES = 8  # alternations of the link and correction fits (converged well before)


def fit_links(cluster: Cluster, measurements: Sequence[tuple]) -> dict:
    """Fit the links and the per-kind corrections from (kind, group size,
    nbytes, seconds) taken with stride 1. Returns Cluster fields, with
    comm_eff = 1 because a fitted bandwidth is already an achieved one.

    One alpha and bw cannot fit kinds that the library implements
    differently (see comm.py), so the model is
        seconds = steps * alpha[class] * latency[kind]
                  + volume / (bw[class] * bandwidth[kind])
    with the reference kind's multipliers fixed at 1 (that is what alpha and
    bw mean). Each measurement is classed intra- or inter-node by the rule
    `collective_time` uses with `cluster.gpus_per_node`; a class without
    data borrows the other's fit. The two halves are fitted in turn, each in
    log space by `fit_alpha_beta`: the links first from the reference kind
    alone, then corrections given the links, then the links from every
    kind's corrected terms, and so on. Letting every kind inform the links
    matters because a kind's multipliers are shared by both classes: links
    set by the reference kind's few timings alone would push any noise in
    them into every other kind's predictions."""
    rows = [(kind, *collective_terms(cluster, kind, nbytes, n), seconds)
            for kind, n, nbytes, seconds in measurements]
    links = _fit_link_classes(rows, {REFERENCE_KIND: (1.0, 1.0)})
    for _ in range(FIT_PASSES):
        corrections = _fit_corrections(rows, links)
        links = _fit_link_classes(rows, corrections)
    corrections = _fit_corrections(rows, links)
    (intra_latency, intra_bw), (inter_latency, inter_bw) = links[False], links[True]
    return dict(intra_latency=intra_latency, intra_bw=intra_bw, inter_latency=inter_latency,
                inter_bw=inter_bw, comm_eff=1.0, comm_corrections=corrections)


def _fit_corrections(rows: Sequence[tuple], links: dict) -> dict[str, tuple[float, float]]:
    """Per kind, the (latency, bandwidth) multipliers of the link terms that
    best fit its timings over all classes; the reference kind's are 1."""
    corrections = {REFERENCE_KIND: (1.0, 1.0)}
    for kind in KINDS:
        mine = [(steps * links[crosses][0], volume / links[crosses][1], seconds)
                for k, steps, volume, crosses, seconds in rows if k == kind]
        if kind != REFERENCE_KIND and len(mine) >= 2:
            corrections[kind] = fit_alpha_beta(mine)
    return corrections


def _fit_link_classes(rows: Sequence[tuple], corrections: dict) -> dict[bool, tuple]:
    """{crosses: (alpha, bw)} from (kind, steps, volume, crosses, seconds)
    rows of the kinds in `corrections`, their terms scaled by them; a class
    with too few such rows uses all of its rows uncorrected."""
    fits = {}
    for crosses in (False, True):
        mine = [r for r in rows if r[3] == crosses]
        scaled = [(s * corrections[k][0], v / corrections[k][1], t)
                  for k, s, v, _, t in mine if k in corrections]
        use = scaled if len(scaled) >= 2 else [(s, v, t) for _, s, v, _, t in mine]
        if len(use) >= 2:
            fits[crosses] = fit_alpha_beta(use)
    if not fits:
        raise ValueError("need at least two collective timings to fit the links")
    intra = fits.get(False, fits.get(True))
    return {False: intra, True: fits.get(True, intra)}
