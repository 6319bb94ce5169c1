"""Collective microbenchmarks: every collective kind the cost model prices,
timed in real process groups (gloo on CPU, NCCL on CUDA).

`measure_collectives` spawns one group of `world_size` rank processes for a
whole plan of (kind, nbytes), with comm.py's meaning of nbytes, and returns
each one's seconds: its fastest op over interleaved rounds, counted at its
slowest rank (`_time_plan` says why). calibrate.py fits the links from these
timings and examples/bench_collectives.py checks a profile against them, so
both time collectives the same way.
"""

from __future__ import annotations

import math
import queue as queue_mod
import socket
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_model.calibration.bench_compute import sync
from cost_model.hardware.comm import KINDS

__all__ = [
    "ROUNDS",
    "STOPPED_EARLY",
    "collective_steps",
    "measure_collective",
    "measure_collectives",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has
# only the old ones. Same (output, input) signatures.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _make_op(kind: str, nbytes: int, rank: int, n: int, dev: str,
             buffers: dict | None = None) -> Callable[[], None]:
    """A closure running one `kind` collective with the cost model's meaning
    of nbytes (see comm.py); float32 elements, length divisible by n. Ops of
    the same size share `buffers` (their contents do not matter), so that a
    whole plan can stay allocated while its rounds are interleaved."""
    numel = max(n, nbytes // 4 // n * n)
    buffers = {} if buffers is None else buffers
    if numel not in buffers:
        buffers[numel] = (torch.zeros(numel, device=dev), torch.zeros(numel // n, device=dev),
                          torch.zeros(numel, device=dev))
    full, shard, out = buffers[numel]
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(full, shard)
    if kind == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(shard, full)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(out, full)
    return _make_pingpong(full, rank)


def _make_pingpong(buf: torch.Tensor, rank: int) -> Callable[[], None]:
    # Two one-way messages (0 -> 1 -> 0); the caller halves the time. A
    # ping-pong needs no clock agreement between the two ranks.
    def op() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return op


# Timed rounds per collective. Each round times every collective of the plan
# once (`inner` ops back to back), and a collective's time is its fastest op
# (see `_time_plan`).
ROUNDS = 15
REP_SECONDS = 0.004  # each timed repetition lasts at least this long
MAX_INNER = 64  # ops per repetition at most
# On a host so loaded that ROUNDS rounds would take longer than this, stop
# after the round that passes it (but not before MIN_ROUNDS): calibration
# has to finish in minutes, and the fastest of a few rounds is already a
# fair estimate.
ROUNDS_BUDGET_S = 40.0
MIN_ROUNDS = 4
STOPPED_EARLY = "stopped early: the host is busy"  # the progress label that says so


def _time_rep(op: Callable[[], None], inner: int, dev: str) -> list[float]:
    """Seconds of each of `inner` back-to-back ops on this rank, starting at
    a barrier: each op from the previous one's return (or the barrier) to its
    own, since gloo ops block until this rank's part is done. In a stream of
    ops each rank starts the next as soon as the last one ends, so that is
    the op's time as the slowest rank sees it."""
    dist.barrier()
    times, last = [], time.perf_counter()
    for _ in range(inner):
        op()
        sync(dev)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def _inner_count(op: Callable[[], None], dev: str) -> int:
    """Ops per timed repetition, agreed by all ranks: enough to give many
    samples of a small op per round without making a round of large ones
    long. Also the warm-up: the first use of a buffer size allocates and
    connects."""
    op()
    fastest = min(_time_rep(op, 2, dev))
    slowest = torch.tensor([fastest], device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(1, min(MAX_INNER, math.ceil(REP_SECONDS / max(slowest.item(), 1e-7))))


def _time_plan(ops: Sequence[Callable[[], None]], dev: str, rounds: int,
               progress: Callable[[str], None]) -> list[float]:
    """Seconds of each of `ops`: the fastest single op over `rounds`
    interleaved repetitions, each op counted at its slowest rank.

    Why the fastest: other processes on a shared host can only add time to a
    collective, and on a loaded 2-core host they add a lot: a process that
    sleeps in a receive waits for the scheduler to run it again, so a
    ping-pong that takes 0.2 ms took 6-8 ms through whole repetitions. The
    fastest op is the one nothing delayed, an estimate of the machine's own
    cost that barely moves with load (as compute is timed by CPU time for
    the same reason), so calibration and the benchmark, run at different
    times, see the same machine. Interleaving the rounds spreads each burst
    of load over the whole plan instead of spoiling every sample of a few
    collectives."""
    inner = [_inner_count(op, dev) for op in ops]
    progress("warm-up")
    times = torch.full((rounds, len(ops), MAX_INNER), math.inf, dtype=torch.float64)
    start = time.perf_counter()
    for r in range(rounds):
        for i, op in enumerate(ops):
            times[r, i, :inner[i]] = torch.tensor(_time_rep(op, inner[i], dev))
        progress(f"round {r + 1}/{rounds}")
        if MIN_ROUNDS <= r + 1 < rounds and _agree_out_of_time(start, dev):
            progress(STOPPED_EARLY)
            break
    times = times.to(dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # unused slots stay inf on every rank
    if dev == "cpu":  # typical, not best: see below
        return _typical(times).clamp(min=1e-7).tolist()
    return times.amin(dim=(0, 2)).clamp(min=1e-7).tolist()


def _typical(times: torch.Tensor) -> torch.Tensor:
    """Per op, the median over rounds of each round's median repetition (inf slots unused).

    On CPU ranks the fastest op is a best case a training step never sees: a megabyte
    all-reduce between two gloo ranks ran 5x faster at its fastest than at its median, since
    the reduction and the copies want the cores the ranks share. Medians of rounds still keep a
    burst of load to the rounds it fell in."""
    rounds = torch.where(torch.isinf(times), torch.nan, times).nanmedian(dim=2).values
    return rounds.nanmedian(dim=0).values


def _agree_out_of_time(start: float, dev: str) -> bool:
    """Whether any rank has spent ROUNDS_BUDGET_S on rounds; all ranks get
    the same answer, so they stop after the same round."""
    late = torch.tensor([float(time.perf_counter() - start > ROUNDS_BUDGET_S)], device=dev)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def _collective_worker(rank, n, port, plan, device, rounds, results) -> None:
    torch.set_num_threads(1)  # one core per rank, as in CPU training
    cuda = device.startswith("cuda")
    dev = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=120),
    )
    try:
        buffers: dict = {}
        ops = [_make_op(kind, nbytes, rank, n, dev, buffers) for kind, nbytes in plan]
        report = (lambda label: results.put(("progress", label))) if rank == 0 else (lambda _: None)
        times = _time_plan(ops, dev, rounds, report)
        if rank == 0:
            results.put(("done", [t / 2 if kind == "p2p" else t
                                  for (kind, _), t in zip(plan, times)]))
    finally:
        dist.destroy_process_group()


def collective_steps(rounds: int = ROUNDS) -> int:
    """Progress steps `measure_collectives` reports per world size."""
    return 1 + rounds


def measure_collectives(
    plan: Sequence[tuple[str, int]],
    world_size: int,
    device: str = "cpu",
    rounds: int = ROUNDS,
    on_progress: Callable[[str], None] | None = None,
) -> list[float]:
    """Seconds of each (kind, nbytes) in `plan`, measured in one process
    group of `world_size` ranks (one spawn for the whole plan, because
    starting the workers costs seconds). Calibration and the benchmarks both
    measure through here, so they time collectives the same way."""
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 to measure collectives, got {world_size}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for kind, _ in plan:
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {list(KINDS)}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (world_size, _free_port(), list(plan), device, rounds, results)
    procs = mp.spawn(_collective_worker, args=args, nprocs=world_size, join=False)
    times = None
    # Drain the queue while waiting: a child with unread queue data cannot exit.
    while True:
        done = procs.join(timeout=0.1)
        try:
            while True:
                tag, value = results.get_nowait()
                if tag == "done":
                    times = value
                elif on_progress is not None:
                    on_progress(value)
        except queue_mod.Empty:
            pass
        if done:
            break
    if times is None:
        raise RuntimeError(f"collective workers (n={world_size}) exited without reporting results")
    return times


def measure_collective(kind: str, nbytes: int, world_size: int, device: str = "cpu") -> float:
    """Seconds of one collective (see comm.py for what nbytes means)."""
    return measure_collectives([(kind, nbytes)], world_size, device)[0]
