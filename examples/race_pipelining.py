"""Race this pipeline runtime against torch.distributed.pipelining on the same stages.

The same GPT is captured once and cut into the same stage GraphModules; one copy runs under our
executor (runtime.training.trainer.PipelineTrainer), another inside torch's PipelineStage with
ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B, on the same gloo ranks with the same
micro-batches and the same optimizer. Full training steps (pipeline + optimizer step) of both
sides are interleaved in pairs as runtime.observe.race describes, each pair giving one ratio of
median step times, fxpar / torch (below 1: fxpar is faster); both sides' first losses (the mean
over the micro-batches) are printed, equal when both trained the same model on the same data.
Torch's schedules run with return_outputs=False, their cheapest mode; our step also hands the
loss to every rank, which theirs does not.

fxpar's ZB-H1 runs twice: with its default split backward (W walks the graph from the outputs
again) and with split_backward="record" (W from the gradients I recorded, as torch's does).

    python examples/race_pipelining.py [--pairs 5] [--steps 5] [--microbatches 8] [--trace out]
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from passes.capture.trace import capture
from planner.interop.emit import schedule_csv
from passes.stages.program import Layout, rank_programs
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import make_optimizer
from runtime.pipeline.generators import make_schedule
from runtime.launch.ranks import run_local
from passes.stages.program import build_pipeline_trainer
from runtime.observe.measure import (balanced_stage_sizes, export_timelines, gather_timeline,
                                    simulate_like)
from runtime.observe.race import interleave, tables
from runtime.comm.mesh import Mesh, mesh_groups
from runtime.training.trainer import TrainOptions

# Big enough that a stage's forward takes milliseconds, small enough for a laptop's CPU.
CONFIG = get_config("gpt-tiny").with_(layers=6, hidden=128, heads=4, vocab=512, seq=64,
                                      global_batch=32, name="gpt-race")
P = 4
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                   "interleaved-1f1b": ScheduleInterleaved1F1B, "zb-h1": _PipelineScheduleRuntime}


def row_schedule(row: str) -> tuple[str, str]:
    """A row's schedule and fxpar's split backward: "zb-h1/record" is ZB-H1 with
    TrainOptions(split_backward="record"), any other row the default."""
    schedule, _, split = row.partition("/")
    return schedule, split or "retraverse"


def _load_ours(schedule: _PipelineScheduleRuntime, name: str, m: int) -> None:
    """Torch has no ZB-H1 class; its action runtime runs ours, read from the compute-only CSV
    both write alike (planner.interop.emit.schedule_csv), and adds the transfers itself."""
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as f:
        f.write(schedule_csv(name, P, m))
        f.flush()
        schedule._load_csv(f.name)


class _TorchStage(nn.Module):
    """A stage GraphModule as torch.distributed.pipelining calls it: received activations (or the
    tokens on the first stage) positionally, the batch's other inputs as keyword arguments
    (torch hands every local stage the same keywords; each takes the ones it reads)."""

    def __init__(self, program):
        super().__init__()
        self.gm = program.gm
        self.data_inputs = program.data_inputs

    def forward(self, *args, **kwargs):
        return self.gm(*args, *(kwargs[n] for n in self.data_inputs if n in kwargs))


def _loss_is_the_output(output, _target):
    return output  # the last stage's graph already computes the loss


class _TorchRunner:
    def __init__(self, captured, name: str, m: int, v: int):
        rank = dist.get_rank()
        stages = tuple(range(rank, P * v, P))
        layout = Layout(1, (), balanced_stage_sizes(len(captured.layers), P * v))
        programs = rank_programs(captured, layout, 0, stages)
        self.modules = [_TorchStage(programs[s]) for s in stages]
        pipeline = [PipelineStage(mod, s, P * v, torch.device("cpu"))
                    for mod, s in zip(self.modules, stages)]
        build = TORCH_SCHEDULES[name]
        runtime = issubclass(build, _PipelineScheduleRuntime)  # takes a list of stages
        self.schedule = build(pipeline if runtime else pipeline[0], m, loss_fn=_loss_is_the_output)
        if build is _PipelineScheduleRuntime:
            _load_ours(self.schedule, name, m)
        self.first, self.last = 0 in stages, P * v - 1 in stages
        self.optimizer = make_optimizer([p for mod in self.modules for p in mod.parameters()])

    def step(self, tokens, targets, losses: list | None = None):
        self.optimizer.zero_grad(set_to_none=True)
        args = (tokens,) if self.first else ()
        extra = {"targets": targets} if self.last else {}
        target = torch.zeros(tokens.shape[0]) if self.last else None
        self.schedule.step(*args, target=target, losses=losses if self.last else None,
                           return_outputs=False, **extra)
        self.optimizer.step()

    def first_loss(self, tokens, targets) -> float:
        """One step that keeps the micro-batches' losses: their mean, on every rank."""
        losses = []
        self.step(tokens, targets, losses)
        total = torch.tensor(float(sum(float(l) for l in losses)) / len(losses) if losses else 0.0,
                             dtype=torch.float64)
        dist.all_reduce(total)  # only the last stage's rank has the losses
        return float(total)


def race(names: tuple[str, ...], m: int, pairs: int, steps: int):
    """Runs on every rank; per schedule: (rounds of runtime.observe.race.interleave, first
    losses), and our measured timeline of the last step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch = example_batch(CONFIG, CONFIG.global_batch)
    micro = CONFIG.global_batch // m
    captured = capture(build_model(CONFIG), tuple(x[:micro] for x in batch))
    groups = mesh_groups(Mesh(P, 1, 1))
    results, timelines = {}, {}
    for name in names:
        schedule, split = row_schedule(name)
        v = 2 if schedule == "interleaved-1f1b" else 1
        ours = build_pipeline_trainer(copy.deepcopy(captured), make_schedule(schedule, P, m, v),
                                      groups, make_optimizer, TrainOptions(split_backward=split))
        theirs = _TorchRunner(copy.deepcopy(captured), schedule, m, v)
        first = {"fxpar": ours.step(*batch), "torch": theirs.first_loss(*batch)}
        runners = {"fxpar": lambda: ours.step(*batch), "torch": lambda: theirs.step(*batch)}
        results[name] = (interleave(runners, pairs, steps, warmup=2), first)
        timelines[name] = gather_timeline(ours)  # our last step, every pipeline rank
    return results, timelines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zb-h1,zb-h1/record",
                        help="'zb-h1/record': fxpar's W from the gradients its I recorded")
    parser.add_argument("--trace", metavar="DIR", default="out",
                        help="write our measured and the simulated timeline of each schedule "
                             "here (Chrome trace .json and .png); '' to skip")
    args = parser.parse_args()
    names = tuple(args.schedules.split(","))
    known = (*TORCH_SCHEDULES, "zb-h1/record")
    if unknown := [n for n in names if n not in known]:
        parser.error(f"unknown schedules {unknown}; choose from {', '.join(known)}")
    print(f"{CONFIG.name}: {CONFIG.layers} blocks, hidden {CONFIG.hidden}, seq {CONFIG.seq}, "
          f"batch {CONFIG.global_batch}; p={P} gloo ranks, m={args.microbatches}, fp32\n")
    results, timelines = run_local(race, P, (names, args.microbatches, args.pairs, args.steps),
                        timeout_s=600)[0]
    for name, timeline in timelines.items():
        if args.trace:
            schedule = make_schedule(row_schedule(name)[0], P, args.microbatches,
                                     2 if "interleaved" in name else 1)
            os.makedirs(args.trace, exist_ok=True)
            export_timelines(timeline, simulate_like(schedule, timeline),
                             os.path.join(args.trace, f"race-{name}"))
    labels = {name: [name] for name in results}
    print(tables(results, labels, ["schedule"]))


if __name__ == "__main__":
    main()
