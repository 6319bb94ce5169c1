"""Compute microbenchmarks: Linear and causal attention forward + backward,
large copies and a tiny op, timed on one device as training runs them.

calibrate.py fits peak_flops, matmul_eff, matmul_overhead, attention_eff,
mem_bw, bw_eff and kernel_floor from these timings, and
examples/bench_costs.py times its transformer blocks with the same timers
(`median_time`, `interleaved_medians`), so that a profile is fitted and
checked on timings taken the same way. FLOPs are counted by the cost model's
own conventions (op_graph.SDPA_BWD_FACTOR, `attention_flops`).

On CPU a "device" is one single-threaded rank (calibrate runs these with one
torch thread), timed by this thread's CPU time, which other processes
sharing the cores do not inflate; GPUs use the wall clock around a
synchronize.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from cost_model.ops.graph_facts import SDPA_BWD_FACTOR

__all__ = [
    "CLOCKS",
    "COMPUTE_ROUNDS",
    "attention_flops",
    "attention_step",
    "interleaved_medians",
    "linear_step",
    "measure_add",
    "measure_attention",
    "measure_copy",
    "measure_kernel_floor",
    "measure_linear",
    "measure_matmul",
    "median_time",
    "sync",
]


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a clock
    read after it counts that work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], device: str, reps: int = 5, inner: int = 1,
                clock: str | None = None) -> float:
    """Median over `reps` of the mean time of `inner` back-to-back calls,
    after one warm-up call. Shared with examples/bench_costs.py, so that
    calibration and the benchmark time compute the same way.

    On CPU a calibrated device is one single-threaded rank: its compute is timed by this thread's
    CPU time (clock "thread"), which other processes sharing the cores do not inflate (the wall
    clock would fit the machine's load at calibration time into the profile). GPUs use the wall
    clock around a synchronize."""
    now = CLOCKS[clock or ("thread" if device == "cpu" else "wall")]
    fn()  # warm-up: first calls pay for allocation and kernel selection
    sync(device)
    times = []
    for _ in range(reps):
        t0 = now()
        for _ in range(inner):
            fn()
        sync(device)
        times.append((now() - t0) / inner)
    return statistics.median(times)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
COMPUTE_ROUNDS = 9  # timed rounds of the compute microbenchmarks


def interleaved_medians(fns: Sequence[Callable[[], object]], device: str,
                        rounds: int = COMPUTE_ROUNDS, clock: str | None = None,
                        on_round: Callable[[int], None] | None = None) -> list[float]:
    """Median seconds of each of `fns`, over `rounds` rounds that call every
    one of them once in turn (after one warm-up call each), timed as
    `median_time` times them. Shared with examples/bench_costs.py.

    Why rounds: a shared host's speed drifts, even by CPU time (a single-
    threaded Linear measured 64-80 GFLOP/s from one minute to the next here),
    so timing each function in one burst lets a fast or slow spell set that
    function's number alone. Interleaved, every function sees the same mix of
    spells over the whole run."""
    now = CLOCKS[clock or ("thread" if device == "cpu" else "wall")]
    for fn in fns:
        fn()  # warm-up: first calls pay for allocation and kernel selection
    sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for fn, mine in zip(fns, times):
            t0 = now()
            fn()
            sync(device)
            mine.append(now() - t0)
        if on_round is not None:
            on_round(r)
    return [statistics.median(mine) for mine in times]


def _dtype(device: str) -> torch.dtype:
    # Match what the presets' peak_flops describe: bf16 on GPU, fp32 on CPU.
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def measure_matmul(m: int, n: int, k: int, device: str = "cpu", reps: int = 5) -> float:
    """Median seconds of one (m x k) @ (k x n) matmul; it does 2*m*n*k FLOPs."""
    a = torch.randn(m, k, device=device, dtype=_dtype(device))
    b = torch.randn(k, n, device=device, dtype=_dtype(device))
    out = torch.empty(m, n, device=device, dtype=_dtype(device))
    return median_time(lambda: torch.mm(a, b, out=out), device, reps)


def measure_linear(m: int, n: int, k: int, device: str = "cpu", reps: int = 5) -> float:
    """Median seconds of `linear_step(m, n, k, device)`."""
    return median_time(linear_step(m, n, k, device), device, reps)


def linear_step(m: int, n: int, k: int, device: str = "cpu",
                chain: int = 1) -> Callable[[], None]:
    """Forward + backward of `chain` Linear layers with bias on m tokens, k -> n -> k -> ...:
    chain * (1 + BWD_FACTOR) * 2*m*n*k FLOPs as the cost model counts them.

    This, not a bare matmul, is what `matmul_eff` prices in training: the
    forward runs x @ W^T (+ bias), the backward grad @ W and grad^T @ x (two
    transposed layouts BLAS runs at its own speeds) plus the bias gradient
    and autograd's bookkeeping. Pricing blocks from bare contiguous matmuls
    made every block predicted too fast. A chain shares one backward call
    among its layers, as a block's layers do: a single small Linear would
    charge autograd's start-up (the runtime's, per action) to its matmuls."""
    dtype = _dtype(device)
    layers = [torch.nn.Linear(*((k, n) if i % 2 == 0 else (n, k)), device=device, dtype=dtype)
              for i in range(chain)]
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n if chain % 2 else k, device=device, dtype=dtype)

    def step() -> None:
        for layer in layers:  # fresh grads, as the first micro-batch writes them
            layer.zero_grad(set_to_none=True)
        x.grad = None
        y = x
        for layer in layers:
            y = layer(y)
        y.backward(grad)

    return step


def measure_attention(b: int, h: int, s: int, d: int, device: str = "cpu") -> float:
    """Median seconds of `attention_step(b, h, s, d, device)`."""
    return median_time(attention_step(b, h, s, d, device), device)


def attention_step(b: int, h: int, s: int, d: int, device: str = "cpu") -> Callable[[], None]:
    """Causal SDPA forward + backward, the attention that decoder training
    runs; the cost model counts 4*b*h*s*s*d / 2 FLOPs forward (causal halves
    them) and SDPA_BWD_FACTOR times that backward.

    A non-causal forward alone (what this used to time) runs at over twice
    the rate per counted FLOP on CPU, which priced attention far too cheap."""
    dtype = _dtype(device)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step() -> None:
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True).backward(grad)

    return step


def attention_flops(b: int, h: int, s: int, d: int) -> float:
    """Forward + backward FLOPs of causal SDPA by the cost model's count."""
    return (1 + SDPA_BWD_FACTOR) * 4 * b * h * s * s * d / 2


def measure_copy(nbytes: int, device: str = "cpu") -> float:
    """Median seconds to copy `nbytes` (2 * nbytes of memory traffic)."""
    x = torch.zeros(nbytes // 4, device=device)
    y = torch.empty_like(x)
    return median_time(lambda: y.copy_(x), device)


def measure_add(nbytes: int, device: str = "cpu") -> float:
    """Median seconds of out = x + y on `nbytes` tensors (3 * nbytes traffic)."""
    x = torch.zeros(nbytes // 4, device=device)
    y, z = torch.zeros_like(x), torch.empty_like(x)
    return median_time(lambda: torch.add(x, y, out=z), device)


# Pointwise activations timed forward + backward, with the FLOPs per element their cost rules
# count (cost_model.ops.tables): GELU 8, SiLU 4, exp 4; the backward counts BWD_FACTOR times that.
POINTWISE_PROBES = (("gelu", 8.0), ("silu", 4.0), ("exp", 4.0))


def pointwise_step(name: str, elements: int, device: str = "cpu") -> Callable[[], None]:
    """Forward + backward of one pointwise op on `elements` values."""
    fn = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
          "exp": torch.exp}[name]
    x = torch.randn(elements, device=device, dtype=_dtype(device), requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        x.grad = None
        fn(x).backward(grad)

    return step


# The shapes calibration times the ops priced per element (cluster.PER_ELEMENT_RULES) at: a
# small model's activations, (tokens, hidden) for the norms; the strided op multiplies a
# head-major view (b, h, s, d) of a (b, s, h, d) tensor, as attention's rotary does.
NORM_SHAPE, STRIDED_SHAPE = (512, 128), (8, 64, 16, 8)


def per_element_steps(rule: str, device: str = "cpu") -> tuple[Callable[[], None],
                                                                Callable[[], None], int]:
    """(forward, forward + backward, elements) of one `rule` op in training (autograd
    recording it; the backward writes fresh input and weight grads)."""
    dtype = _dtype(device)
    if rule == "strided":
        b, s, h, d = STRIDED_SHAPE
        x = torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True)
        other = torch.randn(b, h, s, d, device=device, dtype=dtype)
        module, params = (lambda t: t.transpose(1, 2) * other), []
    else:
        rows, hidden = NORM_SHAPE
        module = (torch.nn.LayerNorm if rule == "layer_norm" else torch.nn.RMSNorm)(
            hidden, device=device, dtype=dtype)
        x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
        params = list(module.parameters())
    grad = torch.randn_like(module(x))

    def forward() -> None:
        module(x)

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(grad)

    return forward, step, x.numel()


def measure_autograd_floors(device: str = "cpu", ops: int = 200,
                            rounds: int = 15) -> tuple[float, float]:
    """(forward, backward) seconds per tiny op of a training step: a chain of `ops`
    multiplies recorded by autograd, then its backward, one autograd node per op."""
    x = torch.ones(16, device=device, requires_grad=True)
    now = CLOCKS["thread" if device == "cpu" else "wall"]
    fwd, bwd = [], []
    for _ in range(rounds + 1):
        sync(device)
        start = now()
        y = x
        for _ in range(ops):
            y = y * 1.0001
        loss = y.sum()
        sync(device)
        mid = now()
        loss.backward()
        sync(device)
        fwd.append(mid - start)
        bwd.append(now() - mid)
    return statistics.median(fwd[1:]) / ops, statistics.median(bwd[1:]) / ops


def measure_kernel_floor(device: str = "cpu") -> float:
    """Seconds per tiny op in a back-to-back stream: the dispatch/launch cost
    every eager kernel pays however little it does."""
    x = torch.ones(1, device=device)
    return median_time(lambda: x.add_(0), device, reps=5, inner=200)
