"""Faults for `fxpar train` runs started from outside (tests/dist/test_train.py,
examples/train_acceptance.py): find a rank's process under a launcher by its RANK, wait for a
step to appear in metrics.jsonl, SIGKILL the rank, kill a whole "node" (a torchrun agent and its
workers)."""
from __future__ import annotations

import json
import os
import signal
import time

WORKER = "planner.training.worker"


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in items if item)


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return WORKER.encode() in f.read()
    except OSError:
        return False


def rank_pid(launcher: int, rank: int) -> int | None:
    """The worker process of global rank `rank` under the launcher process `launcher`."""
    for pid in descendants(launcher):
        if _is_worker(pid) and _environ(pid).get("RANK") == str(rank):
            return pid
    return None


def last_step(metrics: str, attempt: int | None = None) -> int:
    """The highest training step metrics.jsonl holds (of one elastic attempt, if given)."""
    best = 0
    if not os.path.exists(metrics):
        return 0
    with open(metrics) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind") == "train" and (attempt is None or r.get("attempt") == attempt):
                best = max(best, r["step"])
    return best


def wait_for_step(metrics: str, step: int, proc, timeout_s: float = 600,
                  attempt: int | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while last_step(metrics, attempt) < step:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (status {proc.returncode}) before step {step}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step {step} in {metrics} after {timeout_s} s")
        time.sleep(0.05)


def kill_rank(launcher: int, rank: int) -> int:
    """SIGKILL global rank `rank` under `launcher`; its pid."""
    pid = rank_pid(launcher, rank)
    if pid is None:
        raise RuntimeError(f"no worker of rank {rank} under process {launcher}")
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_node(agent: int) -> list[int]:
    """SIGKILL a torchrun agent and every worker under it (a lost machine)."""
    victims = [agent] + descendants(agent)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def step_losses(metrics: str) -> dict[int, dict[int, float]]:
    """attempt -> {step: loss} of a metrics.jsonl (the attempts of one elastic job)."""
    out: dict[int, dict[int, float]] = {}
    with open(metrics) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind") == "train":
                out.setdefault(r["attempt"], {})[r["step"]] = r["loss"]
    return out


def train_on_pool(values: dict) -> dict:
    """planner.training.train.run on a rank of a test's pool, from a config's sections as
    dicts (what planner.training.config.from_dict reads)."""
    from planner.training.config import from_dict
    from planner.training.train import run
    return run(from_dict(values), log=lambda line: None)
