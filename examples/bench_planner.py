"""How long planning takes: presets on 8 to 1024 GPUs, synthetic models of 24 to 1000 layers, and
a 61-block model of three block kinds on 1024 GPUs (planner.models.mixed: 3 wide Llama blocks,
57 narrow ones, 1 GPT-2 block, DeepSeek-V3's sizes; captured whole on the meta device).

    python examples/bench_planner.py [--repeat 3] [--only gpt3-175b/1024 "1000 layers"]

Prints one row per case (median wall and process-CPU time of --repeat runs, every wall time, the
plan found, ILPs and LP relaxations solved) and how time grows with the number of layers. The
search space is the default one, context parallelism included. CPU time is printed beside wall time because it is
far less sensitive to other processes on a shared machine; the load average is printed too.
"""
import argparse
import os
import statistics
import time

import torch
from tabulate import tabulate

from planner.search import ilp
from planner.api import plan
from planner.search.costs import PlanningError
from planner.models.mixed import MixedSpec
from planner.models.presets import get_config

PRESET_CASES = [(m, g) for m in ("gpt2-xl", "llama2-70b", "gpt3-175b") for g in (8, 64, 512, 1024)]
SYNTHETIC_LAYERS = (24, 96, 384, 1000)
MIXED_LABEL = "61 blocks, 3 kinds"
MIXED = MixedSpec(get_config("llama2-70b").with_(layers=1, hidden=7168, heads=56, kv_heads=8,
                                                 vocab=129280, seq=4096),
                  ("llama:18432",) * 3 + ("llama:2048",) * 57 + ("gpt:7168",), global_batch=1536)


class _Mixed:
    """Plans MIXED as a user would: the whole model on the meta device, capture included."""
    global_batch = MIXED.global_batch
    cluster = "h100-sxm-dgx"

    def plan(self, gpus):
        model = MIXED.model(device="meta", dtype=torch.bfloat16)
        tokens = torch.zeros(1, MIXED.base.seq, dtype=torch.long, device="meta")
        return plan(model, gpus, (tokens, tokens), cluster=self.cluster,
                    global_batch=self.global_batch)


def _timed(config, gpus, repeat):
    """(wall times, CPU times, best plan, ILPs solved per run)."""
    solves = []
    original = ilp.solve

    def counting(*args, **kwargs):
        solves.append(1)
        return original(*args, **kwargs)

    ilp.solve = counting
    walls, cpus, best = [], [], None
    try:
        for _ in range(repeat):
            solves.clear()
            start, cpu = time.perf_counter(), time.process_time()
            best = (config.plan(gpus) if isinstance(config, _Mixed) else plan(
                config, gpus, cluster="a100-80g-dgx",
                global_batch=max(config.global_batch, gpus)))[0]
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
    finally:
        ilp.solve = original
    return walls, cpus, best, len(solves)


def _cases(only):
    cases = [(get_config(m), g, f"{m}/{g}") for m, g in PRESET_CASES]
    cases += [(get_config("gpt2-xl", layers=n).with_(name=f"synthetic-{n}"), 64, f"{n} layers")
              for n in SYNTHETIC_LAYERS]
    cases += [(_Mixed(), 1024, MIXED_LABEL)]
    return [c for c in cases if not only or c[2] in only]


def _row(config, gpus, label, repeat):
    load = os.getloadavg()[0]
    try:
        walls, cpus, best, solves = _timed(config, gpus, repeat)
        found = (f"dp={best.dp} tp={best.tp} cp={best.cp} pp={best.pp} {best.schedule}"
                 f"{f' v={best.virtual_stages}' if best.virtual_stages > 1 else ''}"
                 f" mb={best.micro_batch}")
        iteration = f"{best.predicted.iteration_s:.4g}"
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        every = " ".join(f"{w:.2f}" for w in walls)
    except PlanningError as err:  # e.g. 70B parameters and Adam states on 8 GPUs
        wall = cpu = float("nan")
        solves, iteration, every = "-", "-", "-"
        found = "no plan fits: " + str(err).split("; ")[1].split(" (")[0]
    return [label, gpus, f"{wall:.2f}", f"{cpu:.2f}", every, f"{load:.1f}", solves, found,
            iteration]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=[],
                        help='case labels to run, e.g. gpt3-175b/1024 "1000 layers" '
                             f'"{MIXED_LABEL}"')
    args = parser.parse_args()
    plan("gpt-tiny", 8, cluster="cpu-gloo")  # warm up imports and lazy torch initialisation
    rows = []
    for config, gpus, label in _cases(args.only):
        rows.append(_row(config, gpus, label, args.repeat))
        print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
    print()
    print(tabulate(rows, headers=["case", "gpus", f"median s of {args.repeat}", "median CPU s",
                                  "each s", "load", "solves (LP+ILP)", "plan", "iteration s"]))
    synthetic = [float(r[2]) for r in rows if r[0].endswith(" layers")]
    if len(synthetic) == len(SYNTHETIC_LAYERS):
        growth = [f"{b / a:.2f}x" for a, b in zip(synthetic, synthetic[1:])]
        print(f"\nsynthetic models on 64 GPUs: time ratio per 4x layers (24->96->384->1000): "
              f"{growth}")


if __name__ == "__main__":
    main()
