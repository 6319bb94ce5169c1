"""The pipeline executor's own overhead per action, beside torch.distributed.pipelining's.

A GPT so small that a stage's work takes tens of microseconds is cut into 4 stages on 4 gloo
ranks and trained with 8 micro-batches of one sequence, once by fxpar's executor
(runtime.pipeline.executor) and once by torch's PipelineStage under the same schedule, the two
sides' steps interleaved one by one. runtime.observe.overhead times every action each runtime
runs and subtracts the work both share (the stage's forward, autograd, the optimizer step,
blocking waits on transfers); what is left is each runtime's own cost per action:

  F, B     forward and full backward (1F1B: torch's Schedule1F1B)
  I, W     the split backward's input and weight halves (ZB-H1: torch's action runtime runs
           fxpar's ZB-H1 order, as in examples/race_pipelining.py; "zb-h1/record": fxpar's W
           from the gradients its I recorded, whose walk over the graph is overhead here and
           whose saving, a second pass of compute, is not)
  send     posting a boundary tensor to the next or previous stage (fxpar: SEND_F / SEND_B;
           torch: get_*_send_ops and its share of the batched isend/irecv)
  recv     posting a receive (fxpar: RECV_F / RECV_B; torch: get_*_recv_ops and its share)
  step     the rest of the training step, once per step: starting it, waiting for the last
           sends (the wait itself excluded), handing out the loss, scaling gradients

Each figure is microseconds per action, the mean over all ranks and traced steps; "all, per
step" sums a rank's overhead of every kind over one step, then averages over ranks. Torch's
first loss and ours are printed: equal, so both ran the same model on the same data.

    python examples/race_actions.py [--steps 40] [--schedules 1f1b,zb-h1]
"""
from __future__ import annotations

import argparse
import copy
from collections import defaultdict

import torch
import torch.distributed as dist
from tabulate import tabulate

from race_pipelining import P, _TorchRunner, row_schedule

from runtime.observe.overhead import STEP, Overhead

M = 8
KINDS = ("F", "B", "I", "W", "send", "recv", STEP)


def _config():
    from planner.models.presets import get_config
    return get_config("gpt-tiny").with_(layers=4, hidden=32, heads=2, vocab=64, seq=16,
                                        global_batch=M, name="gpt-overhead")


def _one(kind: str):
    return lambda *args, **kwargs: {kind: 1}


def _ops(kind: str):
    """get_*_ops builds a list of operations it does not post: its time, no action counted."""
    return lambda *args, **kwargs: {kind: 0}


def _posted(ops, *args, **kwargs) -> dict[str, int]:
    sends = sum(op.op is dist.isend for op in ops)
    return {"send": sends, "recv": len(ops) - sends}


def _trace_shared(tracer: Overhead) -> None:
    """Work both runtimes hand off, excluded from both: autograd and blocking waits."""
    import torch.autograd as autograd
    work = torch._C._distributed_c10d.Work
    tracer.patch(autograd, "backward", tracer.inner)
    tracer.patch(autograd, "grad", tracer.inner)
    tracer.patch(work, "wait", tracer.inner)
    blocking = lambda *args, **kwargs: not kwargs.get("async_op")  # noqa: E731
    for name in ("broadcast", "all_reduce", "barrier"):
        tracer.patch(dist, name, lambda fn: tracer.inner(fn, blocking))


def _trace_ours(tracer: Overhead, trainer) -> None:
    executor = trainer.executor
    kinds = {"_forward": "F", "_backward": "B", "_backward_input": "I",
             "_backward_weight": "W", "_send_forward": "send", "_send_backward": "send",
             "_recv_forward": "recv", "_recv_backward": "recv"}
    for name, kind in kinds.items():
        tracer.patch(executor, name, lambda fn, kind=kind: tracer.span(_one(kind), fn))
    executor._steps = executor._compile()  # bind the traced handlers
    for program in executor.programs.values():
        tracer.patch(program.gm, "forward", tracer.inner)
    tracer.patch(trainer.optimizer, "step", tracer.inner)


def _trace_torch(tracer: Overhead, runner: _TorchRunner) -> None:
    from torch.distributed.pipelining import schedules
    stages = runner.schedule._stages if hasattr(runner.schedule, "_stages") else \
        [runner.schedule._stage]
    backward = lambda *args, full_backward=True, **kwargs: {"B" if full_backward else "I": 1}  # noqa: E731
    for stage in stages:
        tracer.patch(stage, "forward_one_chunk", lambda fn: tracer.span(_one("F"), fn))
        tracer.patch(stage, "backward_one_chunk", lambda fn: tracer.span(backward, fn))
        tracer.patch(stage, "backward_weight_one_chunk", lambda fn: tracer.span(_one("W"), fn))
        for direction in ("fwd", "bwd"):
            tracer.patch(stage, f"get_{direction}_send_ops",
                         lambda fn: tracer.span(_ops("send"), fn))
            tracer.patch(stage, f"get_{direction}_recv_ops",
                         lambda fn: tracer.span(_ops("recv"), fn))
    for name in ("_batch_p2p", "_sorted_batch_p2p"):
        tracer.patch(schedules, name, lambda fn: tracer.span(_posted, fn))
    for module in runner.modules:
        tracer.patch(module, "forward", tracer.inner)
    tracer.patch(runner.optimizer, "step", tracer.inner)


def race(names: tuple[str, ...], steps: int):
    """Runs on every rank: per schedule, (side, kind) -> (actions, seconds) and first losses."""
    from passes.capture.trace import capture
    from passes.stages.program import build_pipeline_trainer
    from planner.models.presets import build_model, example_batch
    from planner.training.local import make_optimizer
    from runtime.comm.mesh import Mesh, mesh_groups
    from runtime.pipeline.generators import make_schedule
    from runtime.training.trainer import TrainOptions

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = _config()
    batch = example_batch(config, config.global_batch)
    captured = capture(build_model(config), tuple(x[:config.global_batch // M] for x in batch))
    groups = mesh_groups(Mesh(P, 1, 1))
    results = {}
    for name in names:
        schedule, split = row_schedule(name)
        ours = build_pipeline_trainer(copy.deepcopy(captured), make_schedule(schedule, P, M),
                                      groups, make_optimizer, TrainOptions(split_backward=split))
        theirs = _TorchRunner(copy.deepcopy(captured), schedule, M, 1)
        first = {"fxpar": ours.step(*batch), "torch": theirs.first_loss(*batch)}
        runners = {"fxpar": lambda: ours.step(*batch), "torch": lambda: theirs.step(*batch)}
        tracer = Overhead()
        _trace_shared(tracer)
        _trace_ours(tracer, ours)
        _trace_torch(tracer, theirs)
        for _ in range(3):  # warm-up, untraced
            for run in runners.values():
                run()
        for i in range(steps):
            for side in ("fxpar", "torch") if i % 2 == 0 else ("torch", "fxpar"):
                dist.barrier()
                tracer.step(side, runners[side])
        tracer.restore()
        results[name] = (tracer.per_action(), first)
    return results


def table(per_rank: list[dict], steps: int) -> str:
    """Sum the ranks' counts and seconds; microseconds per action, fxpar beside torch."""
    count, seconds = defaultdict(float), defaultdict(float)
    for rank in per_rank:
        for key, (n, s) in rank.items():
            count[key] += n
            seconds[key] += s
    rows = []
    for kind in KINDS:
        if not count["fxpar", kind] and not count["torch", kind]:
            continue
        us = {side: seconds[side, kind] / count[side, kind] * 1e6 if count[side, kind] else None
              for side in ("fxpar", "torch")}
        ratio = us["fxpar"] / us["torch"] if us["fxpar"] and us["torch"] else None
        rows.append([kind, _fmt(us["fxpar"]), _fmt(us["torch"]), _fmt(ratio, ".2f"),
                     _fmt(count["fxpar", kind] / steps / len(per_rank), ".1f"),
                     _fmt(count["torch", kind] / steps / len(per_rank), ".1f")])
    total = {side: sum(s for (who, _), s in seconds.items() if who == side)
             / steps / len(per_rank) * 1e6 for side in ("fxpar", "torch")}
    rows.append(["all, per step", f"{total['fxpar']:.0f}", f"{total['torch']:.0f}",
                 f"{total['fxpar'] / total['torch']:.2f}", "", ""])
    return tabulate(rows, headers=["action", "fxpar us", "torch us", "fxpar / torch",
                                   "fxpar per step", "torch per step"],
                    disable_numparse=True, colalign=("left",) + ("right",) * 5)


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="traced steps per side")
    parser.add_argument("--schedules", default="1f1b,zb-h1,zb-h1/record")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    names = tuple(args.schedules.split(","))
    known = ("1f1b", "gpipe", "zb-h1", "zb-h1/record")
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown schedules {unknown}; choose from {', '.join(known)}")
    config = _config()
    print(f"{config.name}: {config.layers} blocks, hidden {config.hidden}, seq {config.seq}; "
          f"p={P} gloo ranks, m={M} micro-batches of 1, fp32, one thread each; "
          f"{args.steps} traced steps per side\n")
    from runtime.launch.ranks import run_local
    per_rank = run_local(race, P, (names, args.steps), timeout_s=600)
    for name in names:
        first = per_rank[0][name][1]
        print(f"{name}: first loss fxpar {first['fxpar']:.6f}, torch {first['torch']:.6f}")
        print(table([rank[name][0] for rank in per_rank], args.steps), "\n")


if __name__ == "__main__":
    main()
