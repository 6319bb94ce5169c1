"""`fxpar bench`: run the planner's top plans on the devices at hand and compare with predictions.

Each plan runs under `torchrun --standalone --nproc-per-node N` (NCCL on CUDA, gloo on CPU) for a
few steps; rank 0 writes the measured step times and every rank's peak memory to a JSON file. The
table puts predicted and measured side by side, and says whether the planner's first choice was
also the fastest measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tabulate import tabulate

from planner.search.plan import Plan
from runtime.launch.progress import Progress


@dataclass(frozen=True)
class Measured:
    step_s: float              # median over measured steps
    tokens_per_s: float
    peak_memory_bytes: float   # largest over ranks (CUDA: allocator peak; CPU: process RSS)
    losses: tuple[float, ...]
    ranks: tuple[dict, ...] = ()  # per rank: runtime.observe.step_timing.rank_record


STEP = "fxpar-bench-step"  # rank 0's line per step on stdout: STEP done total seconds loss


def run_plan(plan: Plan, config, steps: int, warmup: int, timeout_s: float = 900,
             on_step=None) -> Measured:
    """Launch one plan with torchrun and read back what rank 0 measured; `on_step(done, total,
    seconds, loss)` hears of every step (warm-up included) as it ends."""
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, config_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "model.json")
        out = os.path.join(tmp, "result.json")
        with open(plan_path, "w") as f:
            f.write(plan.dumps())
        with open(config_path, "w") as f:
            json.dump(dataclasses.asdict(config), f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={plan.gpus}", "-m", "planner.bench.plans", "--worker",
               plan_path, config_path, str(steps), str(warmup), out]
        proc = _run(cmd, timeout_s, on_step)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"torchrun failed for dp={plan.dp} tp={plan.tp} pp={plan.pp}:\n"
                               f"{tail}")
        with open(out) as f:
            data = json.load(f)
    return Measured(data["step_s"], data["tokens_per_s"], data["peak_memory_bytes"],
                    tuple(data["losses"]), tuple(data["ranks"]))


def _run(cmd: list[str], timeout_s: float, on_step) -> subprocess.CompletedProcess:
    """subprocess.run(cmd), but rank 0's step lines reach `on_step` while it runs."""
    import threading
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        killed = threading.Event()

        def kill():
            killed.set()
            proc.kill()
        timer = threading.Timer(timeout_s, kill)
        timer.start()
        out = []
        try:
            for line in proc.stdout:
                fields = line.split()
                if len(fields) == 5 and fields[0] == STEP:
                    if on_step is not None:
                        on_step(int(fields[1]), int(fields[2]), float(fields[3]),
                                float(fields[4]))
                else:
                    out.append(line)
            code = proc.wait()
        finally:
            timer.cancel()
        if killed.is_set():
            raise subprocess.TimeoutExpired(cmd, timeout_s)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, "".join(out), err.read())


def _worker(plan_path: str, config_path: str, steps: int, warmup: int, out: str) -> None:
    """Runs on every rank under torchrun."""
    import torch
    import torch.distributed as dist

    from planner.api import ParallelModel
    from planner.models.presets import build_model, config_from_dict, example_batch
    from planner.training.local import make_optimizer
    from runtime.launch.ranks import init_from_env
    from runtime.observe.step_timing import StepClock, rank_record

    init_from_env()
    torch.set_num_threads(1)
    with open(plan_path) as f:
        plan = Plan.from_json(f.read())
    with open(config_path) as f:
        config = config_from_dict(json.load(f))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Built on the meta device: each rank materialises only its shard (planner.weights.materialize);
    # in bf16 on GPUs, as plans price it there (trained as precision "bf16-main").
    model = build_model(config, device="meta",
                        dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    batch = example_batch(config, config.global_batch, device=device)
    pm = ParallelModel(model, plan, [], batch, make_optimizer, seed=0)
    times, losses, clocks = [], [], []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        with StepClock(pm.shard()) as clock:
            losses.append(pm.train_step(*batch))
            dist.barrier()
        seconds = time.perf_counter() - start
        if step >= warmup:
            times.append(seconds)
            clocks.append(clock)
        if dist.get_rank() == 0:
            print(f"{STEP} {step + 1} {warmup + steps} {seconds!r} {losses[-1]!r}", flush=True)
    mine = {"peak": _peak_memory(device), **rank_record(pm.shard(), clocks)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        step_s = statistics.median(times)
        with open(out, "w") as f:
            json.dump({"step_s": step_s, "tokens_per_s": config.global_batch * config.seq / step_s,
                       "peak_memory_bytes": max(r.pop("peak") for r in ranks), "losses": losses,
                       "ranks": ranks}, f)
    pm.close()  # before interpreter exit, where gloo's threads could abort the process


def _peak_memory(device: str) -> float:
    import resource

    import torch
    if device == "cuda":
        return float(torch.cuda.max_memory_allocated())
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def bench(plans: list[Plan], config, steps: int = 10, warmup: int = 2, rounds: int = 1):
    """Run every plan in turn, its steps shown on stderr (runtime.launch.progress: a bar on a terminal,
    a line per step elsewhere). With `rounds` > 1 the plans run in turn that many times (1, 2,
    3, 1, 2, 3, ...) and each plan's result is `combined` over its rounds: a shared host's
    speed drifts over minutes, and in turns every plan sees the same spells."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    runs: list[list[Measured]] = [[] for _ in plans]
    # what plans count: tokens, or a model's samples where its inputs are not sequences
    unit = "tokens" if getattr(config, "sequences", True) else "samples"
    per_step = config.global_batch * (config.seq if unit == "tokens" else 1)
    for r in range(rounds):
        for i, plan in enumerate(plans):
            label = f"plan {i + 1}/{len(plans)}: dp={plan.dp} tp={plan.tp} pp={plan.pp}"
            label += f", round {r + 1}/{rounds}" if rounds > 1 else ""
            bar = Progress(warmup + steps, rate_unit=unit)

            def on_step(done, total, seconds, loss, bar=bar, label=label):
                bar.update(done, per_s=per_step / seconds, loss=loss,
                           label=label + (", warm-up" if done <= warmup else ""))
            try:
                runs[i].append(run_plan(plan, config, steps, warmup, on_step=on_step))
            finally:
                bar.close()
    return [combined(each) for each in runs]


def combined(runs: list[Measured]) -> Measured:
    """One plan's rounds as one result: the median of their step times (tokens/s from it), the
    largest peak memory, and the losses and per-rank records (`--explain`) of the median round
    (of an even count, the faster middle one), so that the parts explained add up to a step like
    the one reported."""
    step_s = statistics.median(m.step_s for m in runs)
    chosen = sorted(runs, key=lambda m: m.step_s)[(len(runs) - 1) // 2]
    return dataclasses.replace(chosen, step_s=step_s,
                               tokens_per_s=chosen.tokens_per_s * chosen.step_s / step_s,
                               peak_memory_bytes=max(m.peak_memory_bytes for m in runs))


def attainable(measured: list[float], tolerance: float = 0.20) -> tuple[float, float] | None:
    """The predictions p of one plan within `tolerance` of every run's measured time
    (|p / m - 1| <= tolerance for each m): [(1 - tolerance) max, (1 + tolerance) min], None when
    that is empty. A profile gives a plan one prediction, so when the host alone spreads its
    runs further apart than (1 + tolerance) / (1 - tolerance) (1.5 at 20%), no cost model meets
    the tolerance in all of them."""
    low, high = (1 - tolerance) * max(measured), (1 + tolerance) * min(measured)
    return (low, high) if low <= high else None


def report(plans: list[Plan], results: list[Measured]) -> str:
    """The plans' predicted and measured step times, rates and peaks side by side: rates in
    tokens, or in samples for a model whose inputs are not sequences (as its plan states)."""
    rows, unit = [], "tokens" if plans[0].sequences else "samples"
    per = 1 if plans[0].sequences else max(plans[0].seq, 1)  # tokens_per_s counts its patches
    for i, (p, m) in enumerate(zip(plans, results)):
        rows.append([i + 1, f"dp={p.dp} tp={p.tp} pp={p.pp} {p.schedule} mb={p.micro_batch}"
                     f"x{p.num_microbatches}", f"{p.predicted.iteration_s * 1e3:.1f}",
                     f"{m.step_s * 1e3:.1f}", f"{p.predicted.iteration_s / m.step_s:.2f}",
                     f"{p.predicted.tokens_per_s / per:,.0f}", f"{m.tokens_per_s / per:,.0f}",
                     f"{p.predicted.peak_memory_bytes / 2**20:.1f}",
                     f"{m.peak_memory_bytes / 2**20:.1f}"])
    table = tabulate(rows, headers=["#", "plan", "predicted ms", "measured ms", "pred/meas",
                                    f"pred {unit}/s", f"meas {unit}/s", "pred peak MiB",
                                    "meas peak MiB"], disable_numparse=True)
    fastest = min(range(len(results)), key=lambda i: results[i].step_s)
    verdict = ("the planner's first choice was also the fastest measured" if fastest == 0 else
               f"the planner's first choice was NOT the fastest measured: plan {fastest + 1} was "
               f"{results[0].step_s / results[fastest].step_s:.2f}x faster")
    note = ("measured peak memory: the CUDA allocator's peak on GPUs; on CPUs the process's "
            "resident memory, which includes the Python runtime and torch itself")
    return f"{table}\n{verdict}\n{note}"


def plot(plans: list[Plan], results: list[Measured], path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{i + 1}: dp{p.dp} tp{p.tp} pp{p.pp}" for i, p in enumerate(plans)]
    x = range(len(plans))
    fig, ax = plt.subplots(figsize=(1.6 * len(plans) + 3, 3.5))
    ax.bar([i - 0.2 for i in x], [p.predicted.iteration_s * 1e3 for p in plans], 0.4,
           label="predicted")
    ax.bar([i + 0.2 for i in x], [m.step_s * 1e3 for m in results], 0.4, label="measured")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per iteration")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def torchrun_command(plan, config, steps: int, folder: str) -> str:
    """Write the plan and model config to `folder` and return the command each node runs."""
    from cost_model.hardware.cluster import get_cluster
    os.makedirs(folder, exist_ok=True)
    plan_path, model_path = os.path.join(folder, "plan.json"), os.path.join(folder, "model.json")
    with open(plan_path, "w") as f:
        f.write(plan.dumps())
    with open(model_path, "w") as f:
        json.dump(dataclasses.asdict(config), f)
    per_node = min(plan.gpus, get_cluster(plan.cluster).gpus_per_node)
    nodes = -(-plan.gpus // per_node)
    return (f"# on each of the {nodes} node(s), with the same files at the same paths:\n"
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint $MASTER_HOST:29500 -m planner.bench.plans --worker {plan_path} "
            f"{model_path} {steps} 0 {os.path.join(folder, 'result.json')}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        argparse.ArgumentParser(description="use `fxpar bench`").print_help()
