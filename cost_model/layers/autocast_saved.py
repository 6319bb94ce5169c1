"""What autocast saves for backward: the bytes of a layer run under torch.autocast, measured on
fake tensors.

Under autocast (the runtime's precision "bf16" / "fp16", runtime.training.trainer) the weights
stay fp32 but every matmul casts its inputs to 16 bits and saves those casts for its backward —
the activation's and the weight's (autocast caches a weight's cast for one forward: each
micro-batch in flight holds its own copy, whatever its size) — while the ops autocast keeps in
fp32 (norms, softmax, the loss) save fp32. Which op saves what follows autocast's own op lists,
so rather than restate them, `autocast_saved` runs the layer's graph once on fake tensors (no
memory) under torch.autocast with saved_tensors_hooks and counts each saved storage once
(parameters and the layer's inputs aside: they are held anyway), the weights' casts apart (a
dispatch mode sees each cast of a parameter): `saved_bytes`. The layer's profile
(cost_model.layers.layer_cost) takes the rest as a share of the rule-based count
(cost_model.ops.node_cost) of the same graph in its own dtype — scaling its
attention-core and replicated parts alike, and with the micro-batch — and the casts as bytes per
micro-batch that do not follow its size (1/tp of them under tensor parallelism).

The autocast run uses the op lists of the device type the planner runs on ("cuda" where a GPU
is present, else "cpu"); the two differ in a few fp32 ops, not in the matmuls that dominate.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _WeightCasts(TorchDispatchMode):
    """Remembers the storages of the casts made of the given parameters."""

    def __init__(self, params):
        super().__init__()
        self.params = {id(p) for p in params}
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.params:
            self.storages[id(out.untyped_storage())] = out.untyped_storage()
        return out


def saved_bytes(sub: fx.GraphModule, inputs: list[torch.Tensor], dtype: torch.dtype
                ) -> tuple[float, float]:
    """(bytes, of which the weights' casts) autograd keeps for `sub`'s backward when its forward
    runs under autocast."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        params = {k: _fake(p, device, p.requires_grad) for k, p in sub.named_parameters()}
        buffers = {k: _fake(b, device, False) for k, b in sub.named_buffers()}
        args = tuple(_fake(x, device, x.is_floating_point()) for x in inputs)
    held = {id(t.untyped_storage()) for t in (*params.values(), *buffers.values(), *args)}
    saved: dict[int, torch.UntypedStorage] = {}  # kept referenced: an id is not reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in held:
            saved.setdefault(id(storage), storage)
        return t
    casts = _WeightCasts(params.values())
    with mode, casts, torch.autocast(device, dtype=dtype), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(sub, {**params, **buffers}, args)
    total = sum(s.nbytes() for s in saved.values())
    return float(total - _bytes(saved, casts.storages)), float(_bytes(saved, casts.storages))


def _bytes(saved: dict, among: dict) -> int:
    return sum(s.nbytes() for key, s in saved.items() if key in among)


def _fake(t: torch.Tensor, device: str, grad: bool) -> torch.Tensor:
    """An empty tensor of t's shape and dtype on `device` (fake inside a FakeTensorMode)."""
    return torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(grad)
