"""The text and JSON forms of a validation of the cost model against published runs
(planner.bench.published.validate): the table, the summary, each group's ranking, the notes."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from planner.bench.published import Ranking, Result, Summary, Validation, rankings

HEADERS = ("run", "model", "gpus", "configuration", "published s", "predicted s", "error %",
           "published tok/s/GPU", "predicted tok/s/GPU", "compute s", "exposed comm s",
           "bubble s")


_ALIGN = ("left", "left", "right", "left") + ("right",) * 8


def table_row(r: Result) -> list[str]:
    row = r.row
    head = [f"{Path(row.source).stem}:{row.line}", row.model, _value(row.gpus, "d"),
            row.configuration(), _value(row.step_s, ".4g")]
    if not r.priced:
        return head + ["not priced", "-", _value(row.tokens_per_s_per_gpu, ",.0f"), "-", "-",
                       "-", "-"]
    return head + [f"{r.predicted_s:.4g}", f"{r.error_pct:+.1f}",
                   f"{row.tokens_per_s_per_gpu:,.0f}", f"{r.predicted_tokens_per_s_per_gpu:,.0f}",
                   *(_seconds(t) for t in (r.compute_s, r.comm_s, r.bubble_s))]


def _value(value, form: str) -> str:
    return "?" if value is None else format(value, form)   # "?": the source does not print it


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


# ---- cross-validation ---------------------------------------------------------------------------

CV_HEADERS = ("run", "model", "gpus", "runtime", "configuration", "published s",
              "in-sample s", "in-sample %", "left-out s", "left-out %")


def cross_validation_report(v: Validation, folds) -> str:
    """The in-sample validation (`v`, priced with the constants fitted on every row) beside
    leave-one-source-out (planner.bench.published_fit.cross_validate): per row, per source and
    overall, and the ranking of each group of rows with the same model and GPU count under the
    left-out prices."""
    from tabulate import tabulate
    inside = {(r.row.source, r.row.line): r for r in v.results}
    left = [r for fold in folds for r in fold.results]
    rows = [_cv_row(inside[(r.row.source, r.row.line)], r) for r in left if r.priced]
    lines = ["fxpar's cost model against published runs: in-sample (constants fitted on every "
             "row) and leave-one-source-out (fitted without the row's source)",
             tabulate(rows, headers=CV_HEADERS, tablefmt="simple", disable_numparse=True,
                      colalign=("left", "left", "right", "left", "left") + ("right",) * 5),
             "", "per source (median |error|, in-sample -> left out; rows within ±25% left out):"]
    for fold in folds:
        ins = [inside[(r.row.source, r.row.line)] for r in fold.results if r.priced]
        out = [r for r in fold.results if r.priced]
        lines.append(f"  {Path(fold.source).stem}: {len(out)} rows, {_median(ins):.1f}% -> "
                     f"{_median(out):.1f}%, {sum(abs(r.error_pct) <= 25 for r in out)} within "
                     f"±25%, worst {max(abs(r.error_pct) for r in out):.1f}%")
    priced = [r for r in left if r.priced]
    ins = [inside[(r.row.source, r.row.line)] for r in priced]
    lines.append(f"overall: {len(priced)} rows, median |error| {_median(ins):.1f}% in-sample, "
                 f"{_median(priced):.1f}% left out; {sum(abs(r.error_pct) <= 25 for r in priced)}"
                 f" of {len(priced)} within ±25% left out")
    groups = [g for g in rankings(priced) if len(g.measured) > 1]
    held = sum(g.verdict.startswith("the measured fastest is predicted fastest")
               or g.verdict.endswith("within 5%") for g in groups)
    lines.append(f"rankings left out: in {held} of {len(groups)} groups of rows with the same "
                 f"model and GPU count the measured fastest is predicted fastest or within 5%")
    lines += [f"  {g.model} on {g.gpus} GPUs: {g.verdict}" for g in groups
              if not (g.verdict.startswith("the measured fastest is predicted fastest")
                      or g.verdict.endswith("within 5%"))]
    return "\n".join(lines)


def _cv_row(inside: Result, out: Result) -> list[str]:
    row = out.row
    return [f"{Path(row.source).stem}:{row.line}", row.model, str(row.gpus), row.runtime,
            row.configuration(), f"{row.step_s:.4g}", f"{inside.predicted_s:.4g}",
            f"{inside.error_pct:+.1f}", f"{out.predicted_s:.4g}", f"{out.error_pct:+.1f}"]


def _median(results) -> float:
    import statistics
    errors = [abs(r.error_pct) for r in results if r.priced]
    return statistics.median(errors) if errors else float("nan")


def folds_json(folds) -> list[dict]:
    return [{"source": f.source,
             "fits": [{"family": x.family, "rows": x.rows, "compute_share": x.after[0],
                       "host_op_s": x.after[1]} for x in f.fits],
             "rows": [_result_json(r) for r in f.results]} for f in folds]


def cmd_validate(args) -> int:
    """Price every published measured run (planner.bench.published) under the runtime that ran
    it and compare; --fit first fits the runtime profiles' terms on the rows, --cross-validate
    also prices each source with terms fitted without it (planner.bench.published_fit)."""
    import json
    import sys

    from planner.bench.published import csv_files, read_rows, select, validate
    from planner.bench.published_fit import cross_validate, fit_all, fit_text
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    runtimes, fits = None, []
    rows = select([r for path in (args.csv or csv_files()) for r in read_rows(path)],
                  args.match)
    if (args.fit or args.cross_validate) and args.cluster:
        raise ValueError("--fit and --cross-validate price each row on the hardware its file "
                         "names: drop --cluster")
    if args.fit or args.cross_validate:
        runtimes, fitted = fit_all(rows, progress=progress)
        fits = [fit_text(f) for f in fitted]
    result = validate(args.cluster, args.csv, args.match, progress=progress, runtimes=runtimes)
    folds = cross_validate(rows, progress=progress, base=(runtimes, fitted)) \
        if args.cross_validate else []
    if args.json:
        data = to_json(result) | ({"cross_validation": folds_json(folds)} if folds else {})
        print(json.dumps(data | {"fits": fits}, indent=2))
        return 0
    text = [report(result)] + ([cross_validation_report(result, folds)] if folds else [])
    print("\n\n".join(["\n".join(fits)] * bool(fits) + text))
    return 0


def validate_parser(sub, epilog: str) -> None:
    """`fxpar validate`'s arguments (planner.cli builds the other subcommands)."""
    v = sub.add_parser("validate", help="price published measured training runs (GPU, BF16) "
                       "and compare fxpar's predicted step times with them",
                       epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--cluster", help="price every row on this cluster preset or profile JSON "
                   "(default: the profile each CSV names, h100-sxm-dgx where it names none)")
    v.add_argument("--fit", action="store_true", help="first fit the runtime profiles' two "
                   "fitted terms (compute_share, host_op_s per family) on the rows and print "
                   "the fits")
    v.add_argument("--cross-validate", action="store_true", help="also leave each source "
                   "(CSV file) out in turn, fit on the others and price it: the error on runs "
                   "the constants were not fitted to (takes minutes)")
    v.add_argument("--csv", action="append", metavar="FILE", help="a CSV of runs in the "
                   "columns of planner/bench/published/*.csv (may be repeated; default: every "
                   "CSV of that folder)")
    v.add_argument("--match", metavar="SUBSTRING", help="only the rows whose model contains "
                   "SUBSTRING (case-insensitive)")
    v.add_argument("--json", action="store_true", help="print the results as JSON")
    v.set_defaults(func=cmd_validate)
