"""Side-by-side races of fxpar against a torch component: steps interleaved, ratios per pair.

A pair is `steps` timed steps of each side, interleaved one by one with who goes first
alternating, so the bursts of load on a shared machine hit both sides alike; each step starts
after a barrier and is measured on the slowest rank (runtime.observe.measure.timed), and each
pair gives one ratio of the two sides' median step times, fxpar / torch (below 1: fxpar is
faster). A row's summary is the median over its pairs and their spread (min-max)."""
from __future__ import annotations

import argparse
import statistics
from typing import Callable

from tabulate import tabulate

from runtime.observe.measure import timed

SIDES = ("fxpar", "torch")


def arguments(doc: str, rows: dict, argv=None) -> argparse.Namespace:
    """A race script's command line: --pairs, --steps, --warmup, --rows (a list of `rows`'
    names, checked) and --quick (2 pairs of 3 steps, 1 warm-up: a smoke check)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side and row")
    parser.add_argument("--rows", default=",".join(rows), help=f"of {', '.join(rows)}")
    parser.add_argument("--quick", action="store_true", help="2 pairs of 3 steps, 1 warm-up")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.steps, args.warmup = 2, 3, 1
    if min(args.pairs, args.steps) < 1 or args.warmup < 0:
        parser.error("--pairs and --steps must be >= 1 and --warmup >= 0")
    args.rows = args.rows.split(",")
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(rows)}")
    return args


def interleave(runners: dict[str, Callable[[], object]], pairs: int, steps: int,
               warmup: int, group=None) -> list[dict[str, list[tuple[float, float]]]]:
    """On every rank: per pair, {side: [(wall s, CPU s) per step]}, after `warmup` untimed
    steps of each side (allocator, autograd, lazy set-ups)."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    rounds = []
    for i in range(pairs):
        pair = {who: [] for who in SIDES}
        for j in range(steps):
            for who in SIDES if (i + j) % 2 == 0 else SIDES[::-1]:
                pair[who].append(timed(runners[who], group))
        rounds.append(pair)
    return rounds


def tables(results: dict[str, tuple[list, dict[str, float]]],
           labels: dict[str, list[str]], headers: list[str]) -> str:
    """The per-pair table and the summary, as text. `results`: row -> (rounds of interleave,
    first loss per side); `labels`: row -> the summary's leading cells, named by `headers`."""
    detail, summary = [], []
    for row, (rounds, first) in results.items():
        medians = [{who: [statistics.median(x) for x in zip(*steps)] for who, steps in r.items()}
                   for r in rounds]
        ratios = [r["fxpar"][0] / r["torch"][0] for r in medians]
        cpu = [r["fxpar"][1] / r["torch"][1] for r in medians]
        for i, r in enumerate(medians):
            detail.append([row, i + 1, f"{r['fxpar'][0] * 1e3:.1f}", f"{r['torch'][0] * 1e3:.1f}",
                           f"{ratios[i]:.3f}", f"{cpu[i]:.3f}"])
        summary.append(labels[row] + [
            f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}",
            f"{statistics.median(cpu):.3f}", f"{first['fxpar']:.6f}", f"{first['torch']:.6f}",
            f"{abs(first['fxpar'] - first['torch']):.1e}", len(ratios)])
    return "\n".join([
        tabulate(detail, headers=["row", "pair", "fxpar ms", "torch ms", "fxpar / torch",
                                  "CPU ratio"], disable_numparse=True),
        "\nms: median step time of the round, wall clock of the slowest rank; CPU: all ranks' "
        "processes together\n",
        tabulate(summary, headers=headers + ["median ratio", "spread (min-max)",
                                             "median CPU ratio", "first loss fxpar",
                                             "first loss torch", "|diff|", "pairs"],
                 disable_numparse=True)])
