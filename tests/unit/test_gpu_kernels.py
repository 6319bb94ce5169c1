"""planner.bench.gpu_kernels: the dry run's stand-in for CUDA's fused RMSNorm gives the values
and gradients of F.rms_norm and keeps for backward what the fused kernel keeps."""
import pytest
import torch
import torch.nn.functional as F

from planner.bench.gpu_kernels import fused_norms, rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_same_values_and_gradients_as_rms_norm(dtype, weighted):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16).to(dtype).requires_grad_()
    w = torch.randn(16).to(dtype).requires_grad_() if weighted else None
    g = torch.randn(3, 5, 16).to(dtype)
    inputs = (x, w) if weighted else (x,)
    want = F.rms_norm(x, (16,), w, 1e-5)
    got = rms_norm(x, (16,), w, 1e-5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, b)


def test_keeps_the_input_and_one_rstd_per_row_in_16_bits():
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    norm = torch.nn.RMSNorm(64).to(torch.bfloat16)
    kept = []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    assert sum(dt == torch.float32 and shape == (4, 64) for shape, dt in kept) >= 2  # composed
    kept.clear()
    with fused_norms(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    assert sorted(kept, key=str) == sorted([((4, 64), torch.bfloat16), ((4, 1), torch.float32),
                                            ((64,), torch.bfloat16)], key=str)


def test_its_backward_on_fake_tensors_allocates_what_the_fused_kernel_does():
    """CUDA's fused backward makes dx and dw and no fp32 copy of the input; the composed CPU
    backward holds several for a moment (a dry run of a GPU plan would count them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runtime.observe.memory_tracker import MemoryTracker
    extra = {}
    for name, norm in (("composed", F.rms_norm), ("fused", rms_norm)):
        fake = FakeTensorMode()
        with fake, MemoryTracker(fake_mode=fake) as tracker:
            x = torch.randn(64, 8, 256, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(256, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn_like(x)
            y = norm(x, (256,), w, 1e-5)
            before = tracker.current_bytes
            tracker.reset_peak()
            torch.autograd.grad(y, (x, w), g)
        extra[name] = (tracker.peak_bytes - before) / (x.numel() * 2)   # in x's bf16 sizes
    assert extra["composed"] > 4 and extra["fused"] < 1.1, extra   # dx and dw


def test_attention_with_dropout_on_the_dry_runs_fake_tensors_keeps_what_fused_kernels_keep():
    """CUDA's flash and memory-efficient kernels draw the dropout inside: they keep q, k, v, the
    output and a logsumexp per row. The CPU's math path keeps the [b, h, s, s] weights, their
    softmax and the mask; only the dry run's own fake tensors take the fused form."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runtime.observe.memory_tracker import MemoryTracker
    held = {}
    for name, fused in (("math", False), ("fused", True)):
        fake = FakeTensorMode()
        kernels = fused_norms(fake) if fused else fused_norms(FakeTensorMode())
        with fake, kernels, MemoryTracker(fake_mode=fake) as tracker:
            q, k, v = (torch.randn(2, 4, 256, 32, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            before = tracker.current_bytes
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            held[name] = (tracker.current_bytes - before) / q.nbytes   # kept for backward
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            assert [g.shape for g in grads] == [q.shape] * 3
    assert held["math"] > 8 and held["fused"] < 1.5, held   # the output and a logsumexp
