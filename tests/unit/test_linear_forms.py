"""passes.capture.linear_forms: a product with a transposed 2-D parameter is captured as the
linear it computes (same values), and tp splits it; a tp block with nothing to split is refused."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.trace import capture
from planner.api import plan
from planner.search.costs import PlanningError

H, V = 16, 32


class Products(nn.Module):
    """A block writing its projections as products, in each of the forms they are written."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.up = nn.Parameter(torch.randn(4 * H, H) * 0.1)
        self.up_bias = nn.Parameter(torch.randn(4 * H) * 0.1)
        self.down = nn.Parameter(torch.randn(H, 4 * H) * 0.1)

    def forward(self, x):
        if self.form == "T":
            h = x @ self.up.T + self.up_bias
            return x + F.gelu(h) @ self.down.T
        if self.form == "t":
            h = torch.matmul(x, self.up.t()) + self.up_bias
            return x + torch.matmul(F.gelu(h), self.down.transpose(0, 1))
        if self.form == "einsum":
            h = torch.einsum("bsh,oh->bso", x, self.up) + self.up_bias
            return x + torch.einsum("bso,ho->bsh", F.gelu(h), self.down)
        raise ValueError(self.form)


class LM(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Products(form) for _ in range(2))
        self.head = nn.Linear(H, V)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _batch():
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, V, (4, 8), generator=gen) for _ in "xy")


@pytest.mark.parametrize("form", ["T", "t"])
def test_products_with_a_transposed_weight_are_captured_as_linears(form):
    torch.manual_seed(0)
    model, batch = LM(form), _batch()
    captured = capture(model, batch)
    linears = [n for n in captured.gm.graph.nodes
               if n.op == "call_function" and n.target in (F.linear, torch.ops.aten.linear.default)]
    assert len(linears) == 4  # up (its bias folded in) and down, in each block
    assert sum(len(n.args) == 3 for n in linears) == 2
    torch.testing.assert_close(captured.gm(*batch), model(*batch), rtol=1e-6, atol=1e-6)
    chosen = plan(model, 2, batch, cluster="cpu-gloo", fix={"tp": 2, "strategy": "tp"})[0]
    assert chosen.tp == 2


def test_a_block_tp_would_split_nothing_of_is_refused_with_why():
    model, batch = LM("einsum"), _batch()
    with pytest.raises(PlanningError, match="holds no linear .* to split: write its products"):
        plan(model, 2, batch, cluster="cpu-gloo", fix={"tp": 2, "strategy": "tp"})
