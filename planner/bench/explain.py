"""`fxpar bench --explain`: where a plan's measured step went, part by part, beside where the
prediction put it.

The prediction is the whole step simulated from the plan (planner.search.step_prediction); the
measurement is each rank's step split into the same parts (runtime.observe.step_timing), averaged over
the measured steps and over the ranks that share a pipeline index (its dp, tp and cp copies).
Both add up to the step on every rank, so the table shows which part the gap comes from.
"""
from __future__ import annotations

import os
import statistics

from tabulate import tabulate

from cost_model.hardware.cluster import Cluster
from planner.search.plan import Plan
from planner.search.step_prediction import predicted_step
from runtime.pipeline.schedule import Action
from runtime.pipeline.simulator import Event, Timeline
from runtime.observe.step_timing import PARTS
from runtime.pipeline.timeline import to_chrome_trace


def measured_parts(plan: Plan, ranks) -> list[dict[str, float]]:
    """Per pipeline rank: the mean of each part over the ranks holding that pipeline index."""
    out = []
    for r in range(plan.pp):
        mine = [x["parts"] for x in ranks if x["pp_rank"] == r]
        names = sorted({n for parts in mine for n in parts})
        out.append({n: statistics.fmean(p.get(n, 0.0) for p in mine) for n in names})
    return out


def _order(names) -> list[str]:
    """Compute parts by stage and kind, then the others in runtime.observe.step_timing's order."""
    compute = sorted((n for n in names if n not in PARTS), key=lambda n: (int(n[1:]), n[0]))
    return compute + [n for n in PARTS if n in names]


def explain_table(plan: Plan, cluster: Cluster, ranks) -> str:
    """Rows: parts; a column per pipeline rank with "predicted / measured" milliseconds; then
    the largest differences, measured minus predicted."""
    predicted = predicted_step(plan, cluster).parts
    measured = measured_parts(plan, ranks)
    names = _order({n for parts in (*predicted, *measured) for n in parts})
    rows, gaps = [], []
    for name in names + ["step"]:
        row = [name]
        for r in range(plan.pp):
            pred = sum(predicted[r].values()) if name == "step" else predicted[r].get(name, 0.0)
            meas = sum(measured[r].values()) if name == "step" else measured[r].get(name, 0.0)
            row.append(f"{pred * 1e3:.2f} / {meas * 1e3:.2f}" if pred or meas else "")
            if name != "step":
                gaps.append((meas - pred, name, r))
        rows.append(row)
    table = tabulate(rows, headers=["part (ms: predicted / measured)"] +
                     [f"rank {r}" for r in range(plan.pp)], disable_numparse=True)
    gaps.sort(key=lambda g: -abs(g[0]))
    top = ", ".join(f"{name} on rank {r} {diff * 1e3:+.2f} ms" for diff, name, r in gaps[:3])
    return f"{table}\nlargest gaps (measured - predicted): {top}"


def measured_timeline(ranks) -> Timeline:
    """The last measured step's compute actions on every rank (tid: the global rank)."""
    return Timeline.from_events([Event(x["rank"], Action.parse(text), start, end)
                                 for x in ranks for text, start, end in x["events"]])


def write_traces(plan: Plan, cluster: Cluster, ranks, path: str) -> str:
    """Chrome trace (Perfetto) of the predicted and the measured step, side by side."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    to_chrome_trace({"predicted": predicted_step(plan, cluster).timeline,
                     "measured": measured_timeline(ranks)}, path)
    return path
