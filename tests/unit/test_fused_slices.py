"""passes.capture.fused_slices: slices of a linear's features that tile them become one sized
split (the same values), in both capture forms; any other slicing is left as it is."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes.capture.fused_slices import slices_to_splits

aten = torch.ops.aten


class Sliced(nn.Module):
    """Phi-3's reading of a fused projection, with `bounds` for its three slices."""

    def __init__(self, bounds=((None, 8), (8, 12), (-4, None))):
        super().__init__()
        self.qkv, self.bounds = nn.Linear(8, 16), bounds

    def forward(self, x):
        y = self.qkv(x)
        (a, b), (c, d), (e, f) = self.bounds
        return y[..., a:b].sum(-1) + y[..., c:d].mean(-1) * y[..., e:f].amax(-1)


def _traced(model, x):
    gm = fx.symbolic_trace(model)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x)
    return gm


def _exported(model, x):
    return torch.export.export(model, (x,)).module()


def _splits(gm):
    return [n.args[1] for n in gm.graph.nodes if n.target is aten.split_with_sizes.default]


@pytest.mark.parametrize("form", [_traced, _exported])
def test_slices_that_tile_the_features_become_one_split(form):
    model, x = Sliced(), torch.randn(2, 3, 8)
    gm = form(model, x)
    slices_to_splits(gm)
    assert _splits(gm) == [[8, 4, 4]]
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("bounds", [((None, 8), (8, 12), (10, None)),   # overlapping
                                    ((None, 8), (8, 12), (13, None)),   # a gap
                                    ((None, 8), (8, 12), (12, 14))])    # short of the end
def test_slices_that_do_not_tile_are_left(bounds):
    model, x = Sliced(bounds), torch.randn(2, 3, 8)
    gm = _traced(model, x)
    slices_to_splits(gm)
    assert _splits(gm) == []
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
