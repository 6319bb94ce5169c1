"""Faults injected into real training runs, to check that failures end every rank fast and are
reported by name (tests/dist/test_faults.py, examples/fault_times.py).

`faulty_worker` trains like planner.training.local.parallel_worker, except that one rank is SIGKILLed (or
raises InjectedFault) at a chosen point of a chosen step:

    forward p2p     the rank's first pipeline send of the step (torch.distributed.isend)
    backward        its first full backward of the step (torch.autograd.backward)
    dp all-reduce   just after it started the data-parallel gradient all-reduce of a stage
    optimizer step  as its optimizer steps

The time of the fault is written to a file first, so the launcher side can measure how long the
run took to end. `interrupted_cli` runs `fxpar run` with ranks that note each finished step in a
folder, for a Ctrl-C from outside.
"""
from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from planner.models.presets import get_config
from runtime.launch import activity
from runtime.launch.ranks import RankFailure, run_local

POINTS = ("forward p2p", "backward", "dp all-reduce", "optimizer step")
CONFIG = get_config("gpt-tiny").with_(layers=2, global_batch=4)
MARKS_ENV = "FXPAR_STEP_MARKS"  # where marking_worker notes the steps done


class InjectedFault(RuntimeError):
    """The error a rank raises where it was told to fail."""


def small_plan(dp: int, pp: int):
    """A plan of CONFIG on dp x pp gloo ranks: no tensor parallelism, one row per micro-batch."""
    from planner.api import plan
    return plan(CONFIG, dp * pp, cluster="cpu-gloo",
                fix={"dp": dp, "tp": 1, "pp": pp, "mb": 1, "strategy": "none",
                     "schedule": "1f1b"})[0]


def arm(point: str, at_step: int, fate: str = "kill", stamp: str | None = None) -> None:
    """In a rank: at `point` of training step `at_step` (runtime.launch.activity's count), write the time
    to `stamp` and then SIGKILL this process (fate "kill") or raise InjectedFault ("raise")."""
    if point not in POINTS or fate not in ("kill", "raise"):
        raise ValueError(f"point must be one of {POINTS} and fate kill or raise")

    def fault(*_args, **_kwargs):
        if activity.step() != at_step:
            return
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        if fate == "raise":
            raise InjectedFault(f"injected fault at the {point} of step {at_step}")
        os.kill(os.getpid(), signal.SIGKILL)

    def before(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            fault()
            return fn(*args, **kwargs)
        return wrapped

    def after(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            fault()
            return result
        return wrapped

    if point == "forward p2p":
        dist.isend = before(dist.isend)
    elif point == "backward":
        torch.autograd.backward = before(torch.autograd.backward)
    elif point == "dp all-reduce":
        from runtime.training.trainer import _GradSync
        _GradSync.start = after(_GradSync.start)
    else:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(fault)


def faulty_worker(plan_json: str, steps: int, victim: int, point: str, at_step: int,
                  fate: str = "kill", stamp: str | None = None):
    """Runs on every rank: CONFIG trained by the plan, with the fault armed on rank `victim`."""
    from planner.training.local import parallel_worker
    if dist.get_rank() == victim:
        arm(point, at_step, fate, stamp)
    return parallel_worker(CONFIG, plan_json, steps, with_grads=False).losses


def marking_worker(config, plan_json: str, steps: int, *rest):
    """planner.training.local.parallel_worker (its further arguments passed on), noting "<pid> <step>" in $FXPAR_STEP_MARKS/rank<r> after
    every step."""
    from planner.training.local import parallel_worker
    from runtime.training.trainer import PipelineTrainer
    folder, step = os.environ[MARKS_ENV], PipelineTrainer.step

    def marked(self, *batch):
        loss = step(self, *batch)
        mark = os.path.join(folder, f"rank{dist.get_rank()}")
        with open(mark + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {activity.step()}")
        os.replace(mark + ".tmp", mark)   # whole: the reader may look at any moment
        return loss

    PipelineTrainer.step = marked
    return parallel_worker(config, plan_json, steps, *rest)


def interrupted_cli(steps: int = 100000) -> None:
    """`fxpar run` of CONFIG on pp=2 gloo ranks for `steps` steps, whose ranks mark their steps
    (run with $FXPAR_STEP_MARKS set; meant to be interrupted)."""
    import planner.training.local
    from planner.cli import main
    # Ctrl-C as a foreground fxpar run gets it: a shell starting this as a background job
    # ignores SIGINT, and Python keeps an inherited "ignore" instead of raising KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    planner.training.local.parallel_worker = marking_worker
    sys.exit(main(["run", "--model", CONFIG.name, "--gpus", "2", "--layers", str(CONFIG.layers),
                   "--steps", str(steps),
                   "--fix", "dp=1,tp=1,pp=2,mb=1,strategy=none,schedule=1f1b"]))


def timed_fault(folder: str, dp: int, pp: int, victim: int, point: str, fate: str = "kill",
                at_step: int = 2, timeout_s: float = 12) -> tuple[RankFailure, float]:
    """Train CONFIG on dp x pp local ranks with the fault armed on `victim`; (the RankFailure
    run_local raised, seconds from the fault to the exit of the last rank)."""
    stamp = os.path.join(folder, "fault-time")
    plan_json = small_plan(dp, pp).dumps()
    try:
        run_local(faulty_worker, dp * pp,
                  (plan_json, at_step + 1, victim, point, at_step, fate, stamp),
                  timeout_s=timeout_s)
    except RankFailure as failure:
        ended = time.time()  # run_local returns once every rank has exited
        with open(stamp) as f:
            return failure, ended - float(f.read())
    raise AssertionError(f"the {point} fault on rank {victim} did not fail the run")


def _children(pid: int) -> set[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def interrupt_cli(folder: str, sig: int = signal.SIGINT, wait_s: float = 120
                  ) -> tuple[int, float, float, set[int], set[int]]:
    """Start `fxpar run` (interrupted_cli) in a subprocess and send `sig` to that process alone
    once both ranks have finished a step. Returns (its exit status, seconds from the signal until
    no rank runs, seconds until it exited, the ranks' pids, those of them still running 2 s
    after it exited). Linux (/proc)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **{MARKS_ENV: folder})
    errors = open(os.path.join(folder, "stderr"), "w+")
    launcher = subprocess.Popen(
        [sys.executable, "-c", "from tests.harness.faults import interrupted_cli; interrupted_cli()"],
        cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        marks = [os.path.join(folder, f"rank{r}") for r in range(2)]
        deadline = time.monotonic() + wait_s
        while not all(os.path.exists(m) for m in marks):
            if launcher.poll() is not None:
                errors.seek(0)
                raise RuntimeError(f"fxpar run ended early: {errors.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not finish a step within {wait_s} s")
            time.sleep(0.1)
        ranks = set()
        for mark in marks:
            with open(mark) as f:
                ranks.add(int(f.read().split()[0]))
        if not ranks <= _children(launcher.pid):
            raise RuntimeError(f"ranks {ranks} are not children of the launcher")
        start = time.monotonic()
        os.kill(launcher.pid, sig)
        ranks_ended = None
        while launcher.poll() is None and time.monotonic() < start + 30:
            if ranks_ended is None and not any(_running(p) for p in ranks):
                ranks_ended = time.monotonic() - start
            time.sleep(0.02)
        code = launcher.wait(timeout=1)
        exited = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        errors.close()
    deadline = time.monotonic() + 2
    while any(_running(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.02)
    if ranks_ended is None and not any(_running(p) for p in ranks):
        ranks_ended = time.monotonic() - start
    left = {p for p in ranks if _running(p)}
    return code, ranks_ended if ranks_ended is not None else math.inf, exited, ranks, left
