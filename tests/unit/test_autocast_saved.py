"""cost_model.layers.autocast_saved: the bytes autocast saves for backward, measured on fake
tensors, against the same block run for real under autocast with its saved tensors counted."""
import pytest
import torch
import torch.fx as fx

from cost_model.layers.autocast_saved import saved_bytes


class Block(torch.nn.Module):
    def __init__(self, h: int = 8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _real(block: torch.nn.Module, x: torch.Tensor, dtype) -> tuple[int, int]:
    """(bytes saved, of which casts of the weights) by a real forward under CPU autocast."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held = params | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held:
            saved[ptr] = t
        return t
    with torch.autocast("cpu", dtype=dtype), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        block(x)
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    casts = sum(t.untyped_storage().nbytes() for t in saved.values()
                if tuple(t.shape) in shapes and t.dtype == dtype)
    return sum(t.untyped_storage().nbytes() for t in saved.values()), casts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_run_saves_what_a_real_run_saves(dtype):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 6, 8, requires_grad=True)
    gm = fx.symbolic_trace(block)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = x
    total, casts = _real(block, x, dtype)
    rest, fake_casts = saved_bytes(gm, [torch.empty(4, 6, 8, device="meta")], dtype)
    assert (rest + fake_casts, fake_casts) == (total, casts)
    assert casts == 2 * (8 * 32 + 32 * 8)  # each linear's weight, once, in 16 bits
