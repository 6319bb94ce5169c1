"""Start ranks: under torchrun (environment variables), or locally as N gloo CPU processes.

`run_local(fn, n)` spawns n processes once, runs fn on each and returns the per-rank results.
`RankPool(n)` keeps n initialised ranks alive and runs many functions on them, which is what tests
use: starting 8 processes costs seconds (each imports torch), a function call on them does not.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(timeout_s: float = 600.0) -> None:
    """Join the process group that torchrun describes in the environment (NCCL on CUDA, else gloo)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeError("not launched by torchrun: RANK/WORLD_SIZE are not set "
                           "(use `torchrun --nproc-per-node N script.py` or runtime.launch.run_local)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _init_local(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _call(fn, args) -> bytes:
    """Run fn and pickle its outcome by value: torch's queues would otherwise share tensors through
    file descriptors that vanish when a rank exits."""
    try:
        outcome = ("ok", fn(*args))
    except BaseException as err:  # noqa: BLE001 - shipped to the parent with its traceback
        outcome = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    return pickle.dumps(outcome)


def _one_shot(rank, world_size, port, timeout_s, fn, args, queue):
    _init_local(rank, world_size, port, timeout_s)
    queue.put((rank, _call(fn, args)))
    dist.destroy_process_group()


def _collect(raw: dict[int, bytes], world_size: int) -> list:
    results = {rank: pickle.loads(blob) for rank, blob in raw.items()}
    errors = [f"rank {r}: {v}" for r, (status, v) in sorted(results.items()) if status == "error"]
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result")
    return [results[r][1] for r in range(world_size)]


def run_local(fn, world_size: int, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """Run fn(*args) on `world_size` fresh gloo ranks; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_one_shot, args=(r, world_size, port, timeout_s, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, outcome = queue.get(timeout=timeout_s * 4)
            results[rank] = outcome
    except queue_module.Empty:  # a rank died or hung: report which ones below
        pass
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    return _collect(results, world_size)


def _pool_worker(rank, world_size, port, timeout_s, inbox, outbox):
    _init_local(rank, world_size, port, timeout_s)
    while True:
        blob = inbox.get()
        if blob is None:
            break
        try:  # a job whose function cannot be imported here is reported, not a dead worker
            fn, args = pickle.loads(blob)
        except Exception as err:  # noqa: BLE001
            outbox.put((rank, pickle.dumps(("error", f"cannot load the job: {err!r}"))))
            continue
        outbox.put((rank, _call(fn, args)))
    dist.destroy_process_group()


class RankPool:
    """`world_size` gloo ranks started once; `pool.run(fn, *args)` runs fn on all of them."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        self.world_size, self.timeout_s = world_size, timeout_s
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world_size, port, timeout_s, self.inboxes[r],
                                        self.outbox))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        job = pickle.dumps((fn, args))
        for inbox in self.inboxes:
            inbox.put(job)
        results: dict[int, bytes] = {}
        deadline = time.monotonic() + self.timeout_s * 4
        while len(results) < self.world_size and time.monotonic() < deadline:
            try:
                rank, outcome = self.outbox.get(timeout=1.0)
                results[rank] = outcome
            except queue_module.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:  # a crashed rank never answers: fail now, not at the deadline
                    raise RuntimeError(f"ranks {dead} of the pool died (exit codes "
                                       f"{[self.procs[r].exitcode for r in dead]})")
        return _collect(results, self.world_size)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
