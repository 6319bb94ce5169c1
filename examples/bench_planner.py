"""How long planning takes: presets on 8 to 1024 GPUs (DeepSeek-V3 on H100s, the rest on A100s),
synthetic models of 24 to 1000 layers, and a 61-block model of three block kinds on 1024 GPUs
(planner.models.mixed: 3 wide Llama blocks, 57 narrow ones, 1 GPT-2 block, DeepSeek-V3's sizes;
captured whole on the meta device).

    python examples/bench_planner.py [--repeat 3] [--only gpt3-175b/1024 "1000 layers"]

Prints one row per case: the median wall and process-CPU time of --repeat runs, every wall time,
the median run's split into capture (tracing the model, and the trial context-parallel rewrite
that says whether cp applies), pricing (profiling and pricing layers in the cost model), search (enumerating configurations and their bounds, making plans: whatever is
not in another part) and ILP (building and solving stage problems, LP relaxations included), in
wall and in CPU seconds, the plan found and the ILPs and LP relaxations solved; then how time
grows with the number of layers.
The search space is the default one, context parallelism included. CPU time is printed beside
wall time because it is far less sensitive to other processes on a shared machine; the load
average is printed too.
"""
import argparse
import os
import statistics
import time

import torch
from tabulate import tabulate

import planner.api
import planner.search.costs
import planner.search.experts
from planner.search import ilp
from planner.api import plan
from planner.search.costs import PlanningError
from planner.models.mixed import MixedSpec
from planner.models.presets import get_config

PRESET_CASES = [(m, g, "a100-80g-dgx") for m in ("gpt2-xl", "llama2-70b", "gpt3-175b")
                for g in (8, 64, 512, 1024)] + [("deepseek-v3", 1024, "h100-sxm-dgx")]
SYNTHETIC_LAYERS = (24, 96, 384, 1000)
MIXED_LABEL = "61 blocks, 3 kinds"
MIXED = MixedSpec(get_config("llama2-70b").with_(layers=1, hidden=7168, heads=56, kv_heads=8,
                                                 vocab=129280, seq=4096),
                  ("llama:18432",) * 3 + ("llama:2048",) * 57 + ("gpt:7168",), global_batch=1536)
# The parts of a planning call and the functions charged to each, exclusive of the parts they
# call (a layer profiled inside capture counts as pricing); search is whatever is left.
SPLIT = ("capture", "pricing", "search", "ILP")
PARTS = (("capture", planner.api, "capture"),
         ("capture", planner.search.costs, "why_not"),      # may the model run context-parallel:
         ("capture", planner.search.costs, "trial_error"),  # the rewrite's checks and its trial
         ("pricing", planner.search.costs, "price"),
         ("pricing", planner.search.costs, "profile_layer"),
         ("pricing", planner.search.experts, "_with_ep"),
         ("ILP", ilp, "solve"),
         ("ILP", ilp, "polish"))


class _Mixed:
    """Plans MIXED as a user would: the whole model on the meta device, capture included."""
    global_batch = MIXED.global_batch
    cluster = "h100-sxm-dgx"

    def plan(self, gpus):
        model = MIXED.model(device="meta", dtype=torch.bfloat16)
        tokens = torch.zeros(1, MIXED.base.seq, dtype=torch.long, device="meta")
        return plan(model, gpus, (tokens, tokens), cluster=self.cluster,
                    global_batch=self.global_batch)


class _Split:
    """Wall and CPU seconds per part while installed: each goes to the innermost part running."""

    def __init__(self):
        self.seconds = dict.fromkeys(SPLIT, 0.0)
        self.cpu = dict.fromkeys(SPLIT, 0.0)
        self.solves = 0                  # ilp.solve calls: ILPs and LP relaxations
        self._part, self._since = "search", (time.perf_counter(), time.process_time())
        self._originals = []

    def _switch(self, part: str) -> str:
        now = time.perf_counter(), time.process_time()
        self.seconds[self._part] += now[0] - self._since[0]
        self.cpu[self._part] += now[1] - self._since[1]
        previous, self._part, self._since = self._part, part, now
        return previous

    def _timed(self, part: str, name: str, fn):
        def timed(*args, **kwargs):
            self.solves += fn is self._solve
            previous = self._switch(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch(previous)
        return timed

    def __enter__(self):
        self._solve = ilp.solve
        for part, module, name in PARTS:
            fn = getattr(module, name)
            self._originals.append((module, name, fn))
            setattr(module, name, self._timed(part, name, fn))
        self._switch("search")  # the call starts now
        return self

    def __exit__(self, *exc):
        self._switch("search")
        for module, name, fn in self._originals:
            setattr(module, name, fn)


def _one_run(config, gpus, cluster):
    """(wall s, CPU s, best plan, _Split) of one planning call."""
    with _Split() as split:
        start, cpu = time.perf_counter(), time.process_time()
        best = (config.plan(gpus) if isinstance(config, _Mixed) else plan(
            config, gpus, cluster=cluster, global_batch=max(config.global_batch, gpus)))[0]
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, best, split


def _cases(only):
    cases = [(get_config(m), g, c, f"{m}/{g}") for m, g, c in PRESET_CASES]
    cases += [(get_config("gpt2-xl", layers=n).with_(name=f"synthetic-{n}"), 64, "a100-80g-dgx",
               f"{n} layers") for n in SYNTHETIC_LAYERS]
    cases += [(_Mixed(), 1024, _Mixed.cluster, MIXED_LABEL)]
    return [c for c in cases if not only or c[3] in only]


def _row(config, gpus, cluster, label, repeat):
    load = os.getloadavg()[0]
    try:
        runs = sorted((_one_run(config, gpus, cluster) for _ in range(repeat)),
                      key=lambda run: run[0])
    except PlanningError as err:  # e.g. 70B parameters and Adam states on 8 GPUs
        found = "no plan fits: " + str(err).split("; ")[1].split(" (")[0]
        return [label, gpus, "nan", "nan", "-", "-", "-", f"{load:.1f}", "-", found, "-"]
    wall, _, best, split = runs[len(runs) // 2]  # the median run, and its split
    found = (f"dp={best.dp} tp={best.tp} cp={best.cp} pp={best.pp} {best.schedule}"
             f"{f' v={best.virtual_stages}' if best.virtual_stages > 1 else ''}"
             f" mb={best.micro_batch}")
    parts = " ".join(f"{split.seconds[p]:.2f}" for p in SPLIT)
    cpu = " ".join(f"{split.cpu[p]:.2f}" for p in SPLIT)
    every = " ".join(f"{w:.2f}" for w, *_ in runs)
    return [label, gpus, f"{wall:.2f}", f"{statistics.median(r[1] for r in runs):.2f}", every,
            parts, cpu, f"{load:.1f}", split.solves, found, f"{best.predicted.iteration_s:.4g}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=[],
                        help='case labels to run, e.g. gpt3-175b/1024 "1000 layers" '
                             f'"{MIXED_LABEL}"')
    args = parser.parse_args()
    plan("gpt-tiny", 8, cluster="cpu-gloo")  # warm up imports and lazy torch initialisation
    rows = []
    for config, gpus, cluster, label in _cases(args.only):
        rows.append(_row(config, gpus, cluster, label, args.repeat))
        print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
    print()
    print(tabulate(rows, headers=["case", "gpus", f"median s of {args.repeat}", "median CPU s",
                                  "each s (sorted)", "split s: " + " ".join(SPLIT),
                                  "CPU split s", "load",
                                  "solves (LP+ILP)", "plan", "iteration s"]))
    synthetic = [float(r[2]) for r in rows if r[0].endswith(" layers")]
    if len(synthetic) == len(SYNTHETIC_LAYERS):
        growth = [f"{b / a:.2f}x" for a, b in zip(synthetic, synthetic[1:])]
        print(f"\nsynthetic models on 64 GPUs: time ratio per 4x layers (24->96->384->1000): "
              f"{growth}")


if __name__ == "__main__":
    main()
