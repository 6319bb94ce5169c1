"""A dry run: one rank's real programs for one training step on fake tensors, on one CPU.

The rank joins a fake process group (torch.distributed's "fake" backend: collectives return at
once, nothing is sent) of the plan's world size as the rank it is asked to be, builds its shard
under a FakeTensorMode (tensors with shapes and no data: a 70B model's shard costs nothing), and
trains under a runtime.observe.memory_tracker MemoryTracker counting that mode's tensors. What
the programs allocate and free is what a real rank's would; only values are missing, so a
step's scalars (a loss read with .item(), a count of targets) read as 1 and a branch on a value
takes that side.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AnyScalar(TorchDispatchMode):
    """Reading a fake tensor's value (aten._local_scalar_dense: .item(), bool(), float()) gives
    1 of its dtype instead of raising: a dry run has shapes and no values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))
