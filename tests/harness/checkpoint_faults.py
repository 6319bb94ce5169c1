"""A save killed mid-write, for tests/dist/test_checkpoint.py: train with checkpoints as
planner.training.resume.checkpoint_worker does, and on one rank, in the save of step `at_step`, write
this rank's checkpoint files, cut the largest in half, and SIGKILL the process before DCP
returns (so the other ranks are still waiting in DCP's final collective)."""
from __future__ import annotations

import glob
import os
import signal

from planner.training.resume import checkpoint_worker


def arm_save_kill(rank: int, at_step: int) -> None:
    """In the rank `rank`: kill it in the middle of the save of step `at_step`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    if dist.get_rank() != rank:
        return
    original = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = original(self, plan, planner)
        if not str(self.path).endswith(f"step-{at_step:08d}.partial"):
            return future
        future.wait()
        mine = glob.glob(os.path.join(str(self.path), f"__{rank}_*.distcp"))
        if mine:
            biggest = max(mine, key=os.path.getsize)
            with open(biggest, "r+b") as f:
                f.truncate(os.path.getsize(biggest) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_then_die


def killed_mid_save_worker(config, plan_json: str, steps: int, root: str, save_every: int,
                           victim: int, at_step: int):
    arm_save_kill(victim, at_step)
    return checkpoint_worker(config, plan_json, steps, root, save_every)
