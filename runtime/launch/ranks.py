"""Start ranks: under torchrun (environment variables), or locally as N gloo CPU processes.

`run_local(fn, n)` spawns n processes once, runs fn on each and returns the per-rank results.
`RankPool(n)` keeps n initialised ranks alive and runs many functions on them, which is what tests
use: starting 8 processes costs seconds (each imports torch), a function call on them does not.

Failures are reported fast and by name. The launcher watches every rank's process and result pipe
at once; when a rank is killed, exits early or raises, the others get a short grace period
(`GRACE_S`) to report, then the launcher ends them and raises RankFailure, whose first line names
the cause: the rank killed by a signal, or else the first rank that raised an error of its own
(not a transport error or timeout caused by a peer), where it was (runtime.launch.activity: step,
pipeline action, collective) and the first line of its error. The other ranks and the full
tracebacks follow. Ctrl-C (SIGINT) or SIGTERM to the launcher ends every rank before it re-raises
KeyboardInterrupt; ranks ignore SIGINT themselves and die with the launcher should it be killed
outright (PR_SET_PDEATHSIG on Linux).
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.launch import activity

DEFAULT_TIMEOUT_S = 60.0
GRACE_S = 2.0   # how long the other ranks may still report once a rank has failed
_POLL_S = 0.25  # how often the launcher looks at the processes while nothing arrives
_STOP_S = 1.0   # SIGTERM, then SIGKILL after this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(timeout_s: float | None = None) -> None:
    """Join the process group that torchrun describes in the environment (NCCL on CUDA, else
    gloo). timeout_s bounds how long a collective waits for a peer that died or went astray:
    by default DEFAULT_TIMEOUT_S on gloo, 600 s on NCCL (whose first collectives of a large job
    set up communicators and can take minutes)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeError("not launched by torchrun: RANK/WORLD_SIZE are not set "
                           "(use `torchrun --nproc-per-node N script.py` or runtime.launch.ranks.run_local)")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if timeout_s is None:
        timeout_s = 600.0 if backend == "nccl" else DEFAULT_TIMEOUT_S
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


class RankFailure(RuntimeError):
    """A distributed run failed. The first line of the message names the cause: which rank,
    where (its activity: step, action or collective) and the first line of its error; then what
    the other ranks did, then the tracebacks. `rank`, `where` and `summary` (that first line)
    are also attributes."""

    def __init__(self, message: str, rank: int | None = None, where: str = ""):
        super().__init__(message)
        self.rank, self.where = rank, where
        self.summary = message.splitlines()[0]

    def write_report(self, folder: str | None = None) -> str:
        """Write the whole message to a new file (in the temporary folder by default); its path."""
        fd, path = tempfile.mkstemp(prefix="fxpar-failure-", suffix=".log", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(str(self) + "\n")
        return path


# -- in the rank processes ----------------------------------------------------------------------
def _init_local(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _die_with(launcher_pid: int) -> None:
    """Be killed when the launcher dies (Linux), and never outlive it; leave Ctrl-C to it.
    Linux sends the signal when the launcher's thread that started this rank ends, so ranks are
    started from a thread that outlives them (run_local's caller; a RankPool's creator)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher_pid:  # the launcher died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _error_outcome(err: BaseException) -> bytes:
    text = str(err).strip()
    head = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    return pickle.dumps(("error", head, traceback.format_exc(), activity.current(), time.time()))


def _call(fn, args) -> bytes:
    """Run fn and pickle its outcome by value (torch's queues would otherwise share tensors
    through file descriptors that vanish when a rank exits). An error carries its first line,
    its traceback, this rank's activity when it was raised, and the time."""
    activity.reset(getattr(fn, "__qualname__", str(fn)))
    try:
        value = fn(*args)
    except BaseException as err:  # noqa: BLE001 - shipped to the parent with its traceback
        return _error_outcome(err)
    try:
        return pickle.dumps(("ok", value))
    except Exception as err:  # noqa: BLE001
        return _error_outcome(TypeError(f"the result cannot be sent to the launcher: {err}"))


def _exit_now(code: int) -> None:
    """End a rank whose error is reported, without the interpreter's teardown (which may block
    on a broken process group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_shot(rank, world_size, port, timeout_s, slot, launcher_pid, conn, fn, args):
    _die_with(launcher_pid)
    activity.share(slot)
    activity.reset("init_process_group")
    try:
        _init_local(rank, world_size, port, timeout_s)
    except BaseException as err:  # noqa: BLE001
        conn.send_bytes(_error_outcome(err))
        _exit_now(1)
    outcome = _call(fn, args)
    conn.send_bytes(outcome)
    if pickle.loads(outcome)[0] != "ok":
        _exit_now(1)
    if dist.is_initialized():  # fn may have ended the run itself (ParallelModel.close)
        dist.destroy_process_group()


def _pool_worker(rank, world_size, port, timeout_s, slot, launcher_pid, conn):
    _die_with(launcher_pid)
    activity.share(slot)
    activity.reset("init_process_group")
    _init_local(rank, world_size, port, timeout_s)
    activity.reset("the wait for a job")
    while True:
        blob = conn.recv_bytes()
        if not blob:
            break
        try:  # a job whose function cannot be imported here is reported, not a dead worker
            fn, args = pickle.loads(blob)
        except Exception as err:  # noqa: BLE001
            conn.send_bytes(_error_outcome(RuntimeError(f"cannot load the job: {err!r}")))
            continue
        conn.send_bytes(_call(fn, args))
        activity.reset("the wait for a job")
    dist.destroy_process_group()


# -- in the launcher ------------------------------------------------------------------------------
_COLLATERAL_TYPES = ("PeerError", "DistBackendError", "DistNetworkError", "DistStoreError")
_COLLATERAL_TEXT = ("gloo", "nccl", "processgroup", "watchdog", "connection closed by peer",
                    "connection reset by peer", "broken pipe")  # backend errors, in lower case


@dataclass
class _Report:
    """What the launcher knows of one rank."""

    state: str            # ok, error, killed (by a signal), exited (without a result), stopped
    where: str = ""       # its activity
    head: str = ""        # the first line of its error, or how it ended
    text: str = ""        # its traceback
    value: object = None  # its result
    when: float = math.inf
    by_launcher: bool = False

    @property
    def failed(self) -> bool:
        return self.state in ("error", "killed", "exited")

    @property
    def collateral(self) -> bool:
        """An error that a failing peer causes (a transport error, a timeout), not a cause."""
        if self.state != "error":
            return False
        kind = self.head.split(":", 1)[0]
        return kind in _COLLATERAL_TYPES or any(t in self.head.lower() for t in _COLLATERAL_TEXT)

    @property
    def is_cause(self) -> bool:
        return self.failed and not self.collateral and not self.by_launcher


def _how_it_ended(code: int | None) -> tuple[str, str]:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return "killed", f"killed by {signal.Signals(-code).name}"
        return "killed", f"killed by signal {-code}"
    if code:
        return "exited", f"exited with status {code} without a result"
    return "exited", "exited without a result"


def _line(rank: int, report: _Report) -> str:
    where = f"in {report.where}" if report.where else ""  # "in step 2, action 1F3", "in fn"
    if report.state == "error":
        return f"rank {rank} failed {where}: {report.head}".replace("  ", " ")
    if report.state == "killed":
        verb = "was ended by the launcher" if report.by_launcher else "died"
        return f"rank {rank} {verb}: {report.head}" + (f", {where}" if where else "")
    if report.state == "stopped":
        return f"rank {rank} was still running {where}; ended by the launcher".replace("  ", " ")
    if report.state == "exited":
        return f"rank {rank} {report.head}" + (f", {where}" if where else "")
    return f"rank {rank} finished"


def _failure(reports: dict[int, _Report]) -> RankFailure:
    """The cause first: a rank killed by a signal, else the first genuine error, else the first
    rank that exited without a result, else the first collateral error, else a rank still
    running."""
    def order(item):
        rank, r = item
        kind = (0 if r.state == "killed" else 1 if r.state == "error" else 2) if r.is_cause \
            else (3 if r.failed else 4 if r.state == "stopped" else 5)
        return kind, r.when, rank

    ranked = sorted(reports.items(), key=order)
    cause_rank, cause = ranked[0]
    lines = [_line(cause_rank, cause)]
    others = [f"  {_line(rank, r)}" for rank, r in sorted(reports.items()) if rank != cause_rank]
    if others:
        lines += ["the other ranks:"] + others
    traces = [(rank, r.text) for rank, r in [(cause_rank, cause)] + sorted(reports.items())
              if r.text]
    seen = set()
    for rank, text in traces:
        if rank not in seen:
            seen.add(rank)
            lines += [f"--- rank {rank} ---", text.rstrip()]
    return RankFailure("\n".join(lines), cause_rank, cause.where)


class _Ranks:
    """`world_size` spawned rank processes, each with a pipe to the launcher and a shared
    activity slot."""

    def __init__(self, target, world_size: int, timeout_s: float, extra: tuple = (),
                 daemon: bool = False):
        ctx = mp.get_context("spawn")
        self.world_size, self.timeout_s = world_size, timeout_s
        port = free_port()
        self.slots = [ctx.Array("c", activity.SLOT_BYTES, lock=False) for _ in range(world_size)]
        pipes = [ctx.Pipe() for _ in range(world_size)]
        self.conns = [ours for ours, _ in pipes]
        self.procs = [ctx.Process(target=target, daemon=daemon,
                                  args=(r, world_size, port, timeout_s, self.slots[r], os.getpid(),
                                        pipes[r][1], *extra))
                      for r in range(world_size)]
        self.stopped: set[int] = set()
        self._closed: set[int] = set()  # ranks whose pipe reached its end
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.stop()
            raise
        finally:
            for _, theirs in pipes:  # so that a rank's death reads as the end of its pipe
                theirs.close()

    def where(self, rank: int) -> str:
        return activity.read(self.slots[rank])

    def gather(self, grace_s: float = GRACE_S, straggler_s: float | None = None
               ) -> dict[int, _Report]:
        """One report per rank. Returns as soon as every rank answered or ended; once one has
        failed, after `grace_s` more (longer when the first failure looks like a peer's
        consequence); once one has answered, after `straggler_s` more (if given)."""
        reports: dict[int, _Report] = {}
        give_up = math.inf
        while len(reports) < self.world_size and time.monotonic() < give_up:
            pending = [r for r in range(self.world_size) if r not in reports]
            waits = ([self.conns[r] for r in pending if r not in self._closed] +
                     [self.procs[r].sentinel for r in pending])
            ready = mp_connection.wait(
                waits, timeout=max(0.0, min(_POLL_S, give_up - time.monotonic())))
            for r in pending:
                if ready or not self.procs[r].is_alive():
                    report = self._look(r)
                    if report is not None:
                        reports[r] = report
                        give_up = min(give_up, self._give_up_at(report, grace_s, straggler_s))
        for r in range(self.world_size):
            if r not in reports:
                reports[r] = _Report("stopped", where=self.where(r), by_launcher=True)
        return reports

    def _give_up_at(self, report: _Report, grace_s: float, straggler_s: float | None) -> float:
        now = time.monotonic()
        if report.is_cause:
            return now + grace_s
        if report.failed:  # a peer's error: its cause may still be on the way
            return now + grace_s + min(self.timeout_s / 2, 10.0)
        return now + straggler_s if straggler_s is not None else math.inf

    def _look(self, rank: int) -> _Report | None:
        """The rank's report if it sent one or ended; None while it is still at work."""
        alive = self.procs[rank].is_alive()  # first: a rank that ended has written everything
        conn = self.conns[rank]
        try:
            blob = conn.recv_bytes() if conn.poll() else None
        except (EOFError, OSError):
            blob = None
            self._closed.add(rank)
        if blob is not None:
            try:
                outcome = pickle.loads(blob)
            except Exception as err:  # noqa: BLE001 - e.g. a result class the launcher lacks
                return _Report("error", head=f"the launcher cannot read its result: {err!r}")
            if outcome[0] == "ok":
                return _Report("ok", value=outcome[1])
            _, head, text, where, when = outcome
            return _Report("error", where=where, head=head, text=text, when=when)
        if alive:
            return None
        self.procs[rank].join()
        state, head = _how_it_ended(self.procs[rank].exitcode)
        return _Report(state, where=self.where(rank), head=head, when=time.time(),
                       by_launcher=rank in self.stopped)

    def stop(self, wait_s: float = 0.0) -> None:
        """End every rank still running: after `wait_s` for them to exit by themselves, SIGTERM,
        then SIGKILL."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for rank, p in enumerate(self.procs):
            if p.pid is not None and p.is_alive():
                self.stopped.add(rank)
                p.terminate()
        deadline = time.monotonic() + _STOP_S
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
        for conn in self.conns:
            conn.close()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)


@contextlib.contextmanager
def _sigterm_interrupts():
    """While the launcher waits, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so it ends the
    ranks on the way out (main thread only, and only where SIGTERM has its default action)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_local(fn, world_size: int, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S,
              grace_s: float = GRACE_S) -> list:
    """Run fn(*args) on `world_size` fresh gloo ranks; returns the results in rank order.
    `timeout_s` is the process-group timeout: a rank waiting longer for a peer fails. Raises
    RankFailure (see the module docstring) when any rank fails; a rank that has not answered
    4 x timeout_s after another answered counts as hung."""
    with _sigterm_interrupts():
        ranks = None
        try:
            ranks = _Ranks(_one_shot, world_size, timeout_s, (fn, args))
            reports = ranks.gather(grace_s, straggler_s=timeout_s * 4)
            ok = all(r.state == "ok" for r in reports.values())
            ranks.stop(wait_s=timeout_s if ok else 0.5)
        except BaseException:
            if ranks is not None:
                ranks.stop()
            raise
    if not ok:
        for rank in ranks.stopped:  # ended here after the cause was known: say where they were
            if reports[rank].state == "stopped":
                reports[rank].where = ranks.where(rank)
        raise _failure(reports)
    return [reports[r].value for r in range(world_size)]


class RankPool:
    """`world_size` gloo ranks started once; `pool.run(fn, *args)` runs fn on all of them.

    A job that raises on every rank leaves the pool usable. When a rank dies, or has to be ended
    because it no longer answers after another rank failed, the pool is closed: `alive` turns
    False and later runs raise."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 grace_s: float = GRACE_S):
        self.world_size, self.timeout_s, self.grace_s = world_size, timeout_s, grace_s
        self.broken: str | None = None
        self._ranks = _Ranks(_pool_worker, world_size, timeout_s, daemon=True)

    @property
    def procs(self):
        return self._ranks.procs

    @property
    def alive(self) -> bool:
        return self.broken is None and self._ranks.alive()

    def run(self, fn, *args) -> list:
        if self.broken is not None:
            raise RuntimeError(f"this pool of ranks was closed after a failure: {self.broken}")
        job = pickle.dumps((fn, args))
        with _sigterm_interrupts():
            try:
                for conn in self._ranks.conns:
                    with contextlib.suppress(OSError):  # a dead rank: reported by gather
                        conn.send_bytes(job)
                reports = self._ranks.gather(self.grace_s, straggler_s=self.timeout_s * 4)
            except BaseException:
                self.broken = "interrupted"
                self._ranks.stop()
                raise
        if all(r.state == "ok" for r in reports.values()):
            return [reports[r].value for r in range(self.world_size)]
        if any(r.state in ("killed", "exited", "stopped") for r in reports.values()):
            self._ranks.stop()
            for rank in self._ranks.stopped:
                if reports[rank].state == "stopped":
                    reports[rank].where = self._ranks.where(rank)
            failure = _failure(reports)
            self.broken = failure.summary
            raise failure
        raise _failure(reports)

    def close(self) -> None:
        if self.broken is None:
            for conn, p in zip(self._ranks.conns, self.procs):
                if p.is_alive():
                    with contextlib.suppress(OSError):
                        conn.send_bytes(b"")
        self.broken = self.broken or "closed"
        self._ranks.stop(wait_s=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
