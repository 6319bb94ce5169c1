"""The text and JSON forms of a validation of the cost model against published runs
(planner.bench.published.validate): the table, the summary, each group's ranking, the notes."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from planner.bench.published import Ranking, Result, Summary, Validation

HEADERS = ("run", "model", "gpus", "configuration", "published s", "predicted s", "error %",
           "published tok/s/GPU", "predicted tok/s/GPU", "compute s", "exposed comm s",
           "bubble s")


_ALIGN = ("left", "left", "right", "left") + ("right",) * 8


def table_row(r: Result) -> list[str]:
    row = r.row
    head = [f"{Path(row.source).stem}:{row.line}", row.model, str(row.gpus), row.configuration(),
            f"{row.step_s:.4g}"]
    if not r.priced:
        return head + ["not priced", "-", f"{row.tokens_per_s_per_gpu:,.0f}", "-", "-", "-", "-"]
    return head + [f"{r.predicted_s:.4g}", f"{r.error_pct:+.1f}",
                   f"{row.tokens_per_s_per_gpu:,.0f}", f"{r.predicted_tokens_per_s_per_gpu:,.0f}",
                   *(_seconds(t) for t in (r.compute_s, r.comm_s, r.bubble_s))]


def _seconds(t: float) -> str:
    return f"{t:.4g}" if abs(t) >= 1e-6 else "0"  # a bubble of 1e-17 s is rounding


def report(v: Validation) -> str:
    from tabulate import tabulate
    lines = [f"fxpar's cost model ({v.cluster}) against published measured training runs",
             tabulate([table_row(r) for r in v.results], headers=HEADERS, tablefmt="simple",
                      disable_numparse=True, colalign=_ALIGN)]
    lines += [f"not priced: {_label(r)}: {r.reason}" for r in v.results if not r.priced]
    lines += [f"memory: {_label(r)}: {r.memory_note}" for r in v.results if r.memory_note]
    lines += ["", summary_text(v.summary)]
    lines += [line for g in v.rankings for line in ranking_text(g)]
    if v.notes:
        lines += ["", "what fxpar does not express, per model "
                      "(planner/bench/published/models.json):"]
        lines += [f"  {model}: {note}" for model, note in v.notes]
    return "\n".join(lines)


def summary_text(s: Summary) -> str:
    if not s.priced:
        return f"none of the {s.rows} rows could be priced"
    return (f"{s.priced} of {s.rows} rows priced: median |error| {s.median_abs_error_pct:.1f}%, "
            f"max |error| {s.max_abs_error_pct:.1f}%, within ±10%: {s.within_10}, within ±20%: "
            f"{s.within_20}")


def ranking_text(g: Ranking) -> list[str]:
    names = {id(r): f"#{i}" for i, r in enumerate(g.measured + g.unpriced, 1)}
    order = lambda rs: _order([(names[id(r)], tokens) for r, tokens in rs])  # noqa: E731
    lines = ["", f"ranking of {g.model} on {g.gpus} GPUs by tokens/s per GPU:"]
    lines += [f"  {names[id(r)]} = {_label(r)}" for r in g.measured + g.unpriced]
    if g.measured:
        lines.append("  measured:  " + order((r, r.row.tokens_per_s_per_gpu) for r in g.measured))
        lines.append("  predicted: " + order((r, r.predicted_tokens_per_s_per_gpu)
                                             for r in g.predicted))
    lines += [f"  {names[id(r)]} not priced" for r in g.unpriced]
    return lines + [f"  {g.verdict}"]


def _order(runs: list[tuple[str, float]]) -> str:
    """'#1 (6,667) > #2 (5,762)', '=' between equal throughputs."""
    text = f"{runs[0][0]} ({runs[0][1]:,.0f})"
    for (_, before), (name, tokens) in zip(runs, runs[1:]):
        text += f" {'=' if tokens >= before * (1 - 1e-9) else '>'} {name} ({tokens:,.0f})"
    return text


def _label(r: Result) -> str:
    return (f"{Path(r.row.source).stem}:{r.row.line} {r.row.model} on {r.row.gpus} GPUs, "
            f"{r.row.configuration()}, {r.row.kernels}")


def to_json(v: Validation) -> dict:
    return {"cluster": v.cluster, "rows": [_result_json(r) for r in v.results],
            "summary": dataclasses.asdict(v.summary),
            "rankings": [{"model": g.model, "gpus": g.gpus,
                          "measured": [_run(r) for r in g.measured],
                          "predicted": [_run(r) for r in g.predicted],
                          "not_priced": [_run(r) for r in g.unpriced], "verdict": g.verdict}
                         for g in v.rankings],
            "notes": dict(v.notes)}


def _run(r: Result) -> str:
    return f"{r.row.source}:{r.row.line}"


def _result_json(r: Result) -> dict:
    return {"source": r.row.source, "line": r.row.line, "model": r.row.model,
            "gpus": r.row.gpus, "configuration": r.row.configuration(), "kernels": r.row.kernels,
            "fix": dict(r.fix), "published_step_s": r.row.step_s,
            "predicted_step_s": r.predicted_s, "error_pct": r.error_pct,
            "published_tokens_per_s_per_gpu": r.row.tokens_per_s_per_gpu,
            "predicted_tokens_per_s_per_gpu": r.predicted_tokens_per_s_per_gpu,
            "compute_s": r.compute_s, "exposed_comm_s": r.comm_s, "bubble_s": r.bubble_s,
            "reason": r.reason or None, "memory_note": r.memory_note or None}
