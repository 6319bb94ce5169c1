"""Live tensor bytes of one rank, followed op by op, and their peak split by what they hold.

`MemoryTracker` is a TorchDispatchMode: every tensor an op returns has its storage recorded once
(a storage is counted whole, however many views of it exist) with a weak reference whose callback
subtracts its bytes when the storage is freed. So the tracker knows the live bytes after every op,
split by what each storage holds as far as it is known then (`mark`, else who made it):

  parameters   the weights (and buffers) of the rank's stages
  gradients    the .grad tensors (or the flat buckets they are views of)
  optimizer    the optimizer's state tensors (moments, fp32 master copies)
  activations  what a forward made that is still alive: what autograd saved for backward, the
               tensors a stage hands on or receives, the logits and the loss
  other        what a backward or an optimizer step made (temporaries, recomputed activations)
               and what set-up left (communication buffers, the batch)

It works on any device and on fake tensors (FakeTensorMode), whose storages have sizes but no
data: which is how a dry run measures programs of any size (planner.bench.dry_run). Storages
made before the tracker started are not seen unless marked (`mark` adds them), so start it before
the model is built or mark its parameters. The same idea as torch.distributed._tools.mem_tracker,
written here because that one refuses a module whose forward runs more than once per step (every
micro-batch of a pipeline does) and knows nothing of pipeline stages.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")


class _Storage:
    """What the tracker knows of one storage: its size, its category once marked, whether a
    forward made it (the category it has until marked: `kind`)."""

    __slots__ = ("nbytes", "category", "ref", "forward", "seq", "__weakref__")

    def __init__(self, nbytes: int, forward: bool, seq: int):
        self.nbytes, self.category, self.ref, self.forward = nbytes, None, None, forward
        self.seq = seq          # the tracker's count of storages when this one came

    @property
    def kind(self) -> str:
        """As marked, else an activation if a forward made it (it outlived the op that made
        it: something keeps it for the backward, or it crosses to the next stage), else
        "other" (the backward's and the optimizer's temporaries)."""
        return self.category or ("activations" if self.forward else "other")


def _storage(t: torch.Tensor, fake_mode):
    """The tensor's storage, or None for tensors that have none to count: sparse, nested, meta,
    and fake tensors other than those of `fake_mode` (a capture's shape propagation inside
    the run makes fake tensors that hold no memory), or real ones when fake_mode is given."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return None   # a meta tensor, fake or not, holds nothing
    if isinstance(t, FakeTensor):
        if t.fake_mode is not fake_mode:
            return None
    elif fake_mode is not None:
        return None
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


class MemoryTracker(TorchDispatchMode):
    """Tracks the live bytes of every tensor storage made while it is active (see the module
    docstring); `peak_bytes`, `split()` and `current_bytes` after the run. With `fake_mode`
    (a FakeTensorMode) it counts that mode's fake tensors instead of real ones.

    The live bytes are kept per category as storages come, go and are marked, and a new peak
    copies those five sums: a step of a large model's program (hundreds of thousands of ops,
    thousands of live storages) costs no more than its ops. A storage marked later that was
    alive at the peak (made before it, alive still) moves there too; what was freed unmarked
    keeps the category it had: so mark parameters and buffers after set-up, gradients as
    autograd makes them (`watch_gradients`), optimizer states after a first step that the peak
    then leaves out (`reset_peak`)."""

    def __init__(self, fake_mode=None):
        super().__init__()
        self.fake_mode = fake_mode
        self._known: dict[int, _Storage] = {}    # id(storage object) -> its record
        self._live = dict.fromkeys(CATEGORIES, 0)
        self._at_peak = dict(self._live)
        self._seq = 0                            # storages recorded so far
        self._peak_seq = 0                       # ... when the peak was reached
        self.current_bytes = 0
        self.peak_bytes = 0
        self._phase = None                       # "optimizer" inside a watched step
        self._hooks = []
        self._resize = None

    # --- what the storages are ---------------------------------------------------------------
    def mark(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Say what these tensors' storages hold (they are added if not yet seen). A storage
        keeps the first category given: a parameter's storage that a gradient views stays a
        parameter."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        for t in tensors:
            info = self._record(t)
            if info is not None and info.category is None:
                self._recategorize(info, category)

    def mark_unmarked(self, category: str) -> None:
        """Every storage alive now that nothing marked is `category` (what set-up left)."""
        for info in list(self._known.values()):
            if info.category is None:
                self._recategorize(info, category)

    def _recategorize(self, info: _Storage, category: str) -> None:
        if info.seq <= self._peak_seq:   # alive now and made before the peak: alive at it
            self._at_peak[info.kind] -= info.nbytes
            self._at_peak[category] += info.nbytes
        self._live[info.kind] -= info.nbytes
        info.category = category
        self._live[category] += info.nbytes

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """What this optimizer's step makes and nothing marks is a temporary ("other"), not an
        activation: the step runs outside any forward (foreach AdamW's sqrt of the second
        moments, for one, is as large as the parameters)."""
        def enter(*_):
            self._phase = "optimizer"

        def leave(*_):
            self._phase = None
        self._hooks += [optimizer.register_step_pre_hook(enter),
                        optimizer.register_step_post_hook(leave)]

    def watch_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Gradients autograd makes for these parameters are marked as it makes them."""
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p: self.mark([p.grad], "gradients")))

    # --- following allocations ---------------------------------------------------------------
    def _record(self, t) -> _Storage | None:
        storage = _storage(t, self.fake_mode)
        if storage is None:
            return None
        key = id(storage)
        info = self._known.get(key)
        if info is not None and info.ref() is storage:
            return info
        self._seq += 1
        info = _Storage(storage.nbytes(),
                        self._phase is None and torch._C._current_graph_task_id() == -1,
                        self._seq)
        try:
            info.ref = weakref.ref(storage, lambda _, key=key, info=info: self._free(key, info))
        except TypeError:   # a storage type without weak references: counted, never freed
            info.ref = lambda storage=storage: storage
        self._known[key] = info
        self._grow(info, info.nbytes)
        return info

    def _grow(self, info: _Storage, nbytes: int) -> None:
        self._live[info.kind] += nbytes
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._at_peak = dict(self._live)
            self._peak_seq = self._seq

    def _free(self, key: int, info: _Storage) -> None:
        if self._known.get(key) is info:
            del self._known[key]
        self._live[info.kind] -= info.nbytes
        self.current_bytes -= info.nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._record(t)
        if func._overloadpacket in _RESIZES:   # resize_ may grow a storage in place
            self._resized(args[0].untyped_storage())
        return out

    def _resized(self, storage) -> None:
        info = self._known.get(id(storage))
        if info is not None and info.ref() is storage and storage.nbytes() != info.nbytes:
            grown = storage.nbytes() - info.nbytes
            info.nbytes += grown
            self._grow(info, grown)

    def __enter__(self):
        # Sharded data parallel frees and regrows a gathered buffer's storage in place
        # (UntypedStorage.resize_), which no op dispatch sees: follow it while tracking.
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            result = resize(storage, nbytes)
            self._resized(storage)
            return result
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return super().__exit__(*exc)

    # --- results -----------------------------------------------------------------------------
    def split(self) -> dict[str, int]:
        """The peak's bytes by category."""
        return dict(self._at_peak)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (e.g. after a warm-up step)."""
        self.peak_bytes = self.current_bytes
        self._at_peak = dict(self._live)
        self._peak_seq = self._seq


_RESIZES = {torch.ops.aten.resize_, torch.ops.aten.set_}
