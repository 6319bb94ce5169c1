"""How long planning takes: presets on 8 to 1024 GPUs and synthetic models of 24 to 1000 layers.

    python examples/bench_planner.py [--repeat 3] [--full-space]

Prints one row per case (median wall time of --repeat runs, the plan found, ILPs solved) and how
time grows with the number of layers.
"""
import argparse
import statistics
import time

from tabulate import tabulate

from planner import ilp
from planner.api import plan
from planner.costs import PlanningError
from planner.models import get_config

PRESET_CASES = [(m, g) for m in ("gpt2-xl", "llama2-70b", "gpt3-175b") for g in (8, 64, 512, 1024)]
SYNTHETIC_LAYERS = (24, 96, 384, 1000)


def _timed(config, gpus, repeat, full):
    solves = []
    original = ilp.solve

    def counting(*args, **kwargs):
        solves.append(1)
        return original(*args, **kwargs)

    ilp.solve = counting
    times, best = [], None
    try:
        for _ in range(repeat):
            solves.clear()
            start = time.perf_counter()
            best = plan(config, gpus, cluster="a100-80g-dgx", global_batch=max(
                config.global_batch, gpus), runnable_only=not full)[0]
            times.append(time.perf_counter() - start)
    finally:
        ilp.solve = original
    return statistics.median(times), best, len(solves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--full-space", action="store_true",
                        help="price sequence parallel and recomputation too")
    args = parser.parse_args()
    plan("gpt-tiny", 8, cluster="cpu-gloo")  # warm up imports and lazy torch initialisation
    rows = []
    cases = [(get_config(m), g, m) for m, g in PRESET_CASES]
    cases += [(get_config("gpt2-xl", layers=n).with_(name=f"synthetic-{n}"), 64, f"{n} layers")
              for n in SYNTHETIC_LAYERS]
    for config, gpus, label in cases:
        try:
            seconds, best, solves = _timed(config, gpus, args.repeat, args.full_space)
            found = f"dp={best.dp} tp={best.tp} pp={best.pp} {best.schedule}"
            iteration = f"{best.predicted.iteration_s:.4g}"
        except PlanningError as err:  # e.g. 70B parameters and Adam states on 8 GPUs
            seconds, solves, iteration = float("nan"), "-", "-"
            found = "no plan fits: " + str(err).split("; ")[1].split(" (")[0]
        rows.append([label, gpus, f"{seconds:.2f}", solves, found, iteration])
        print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
    print()
    print(tabulate(rows, headers=["model", "gpus", f"median s of {args.repeat}", "ILPs",
                                  "plan", "iteration s"]))
    synthetic = [float(r[2]) for r in rows[-len(SYNTHETIC_LAYERS):]]
    growth = [f"{b / a:.2f}x" for a, b in zip(synthetic, synthetic[1:])]
    print(f"\nsynthetic models on 64 GPUs: time ratio per 4x layers (24->96->384->1000): {growth}")


if __name__ == "__main__":
    main()
