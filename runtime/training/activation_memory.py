"""Measure the activation memory a pipeline schedule keeps alive: bytes of the tensors autograd
saves for backward, counted while they are alive, per stage.

`SavedActivations.saving(stage)` installs torch.autograd.graph.saved_tensors_hooks around a stage's
forward. Each saved tensor is wrapped in a small handle; the handle lives exactly as long as
autograd keeps the tensor for backward (it is released when the backward that uses it frees the
graph), so counting handles alive gives the activation bytes alive at every moment.

What is counted: whole storages, each once however many ops save it or views of it (a saved view
keeps its entire storage alive). What is not: parameters, buffers and the step's input data
(tokens, targets) - they exist whatever the schedule does.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterable

import torch

from runtime.programs.saved import without_graph


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Saved:
    """Handle autograd stores instead of a saved tensor; its lifetime is the tensor's."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, owner: SavedActivations, tensor: torch.Tensor, key, stage: int):
        self.tensor, self.key, self.owner = tensor, key, owner
        owner._acquire(key, stage)

    def __del__(self):
        self.owner._release(self.key)


class SavedActivations:
    """Saved-activation bytes alive now and at peak, per stage and in total (this rank)."""

    def __init__(self, modules: Iterable[torch.nn.Module] = ()):
        self._ignored: set[int] = set()
        for module in modules:
            self.ignore(list(module.parameters()) + list(module.buffers()))
        self._live: dict[tuple[int, int], list] = {}  # storage -> [handles, stage]
        self.current: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)
        self.last_forward: dict[int, int] = {}  # bytes the latest forward of a stage saved
        self.total = 0
        self.total_peak = 0

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (weights, input data)."""
        self._ignored.update(t.untyped_storage().data_ptr() for t in tensors)

    def reset_peaks(self) -> None:
        self.peak = defaultdict(int, self.current)
        self.total_peak = self.total

    @contextlib.contextmanager
    def saving(self, stage: int, ignore: Iterable[torch.Tensor] = ()):
        """Count what autograd saves inside this block as activations of `stage`."""
        skip = self._ignored | {t.untyped_storage().data_ptr() for t in ignore}

        def pack(t: torch.Tensor):
            key, t = _storage_key(t), without_graph(t)
            return t if key[0] in skip or key[1] == 0 else _Saved(self, t, key, stage)

        def unpack(packed):
            return packed.tensor if isinstance(packed, _Saved) else packed

        before = self.current[stage]
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.last_forward[stage] = self.current[stage] - before  # nothing is freed mid-forward

    def _acquire(self, key, stage: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[0] += 1
            return
        self._live[key] = [1, stage]
        self.current[stage] += key[1]
        self.total += key[1]
        self.peak[stage] = max(self.peak[stage], self.current[stage])
        self.total_peak = max(self.total_peak, self.total)

    def _release(self, key) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current[entry[1]] -= key[1]
            self.total -= key[1]
