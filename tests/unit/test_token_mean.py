"""passes.rewrite.token_mean on its own: a rewritten loss outside the trainer is the original loss; its
counter counts the targets the mean divides by; a step with none is refused."""
import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from passes.rewrite.token_mean import loss_counts, token_mean
from runtime.training.loss_tokens import StepTokens
from runtime.programs.stage import StageProgram


class _Loss(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        self.proj = torch.nn.Linear(8, 5)

    def forward(self, x, targets):
        return F.cross_entropy(self.proj(x).flatten(0, 1), targets.flatten(), **self.kwargs)


def _batch(ignored: int = -100):
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 5, (3, 4), generator=gen)
    targets[0, :3] = ignored
    return torch.randn(3, 4, 8, generator=gen), targets


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum"}, {"label_smoothing": 0.2},
                                    {"weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])},
                                    {"ignore_index": 2}])
def test_a_rewritten_loss_outside_the_trainer_is_the_original(kwargs):
    model, batch = _Loss(**kwargs), _batch(kwargs.get("ignore_index", -100))
    gm = token_mean(fx.symbolic_trace(model))
    assert any(n.target is F.cross_entropy and n.kwargs["reduction"] == "sum"
               for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*batch), model(*batch), rtol=1e-6, atol=0)
    (count,) = loss_counts(gm)
    if kwargs.get("reduction") == "sum":
        assert count.counter is None
        return
    targets = batch[1].flatten()
    valid = targets != kwargs.get("ignore_index", -100)
    weight = kwargs.get("weight", torch.ones(5))
    expected = weight[targets[valid]].sum()
    assert count.inputs == ("targets",)
    torch.testing.assert_close(count.counter(batch[1]), expected)


def test_a_step_whose_targets_are_all_ignored_is_refused():
    gm = token_mean(fx.symbolic_trace(_Loss()))
    program = StageProgram(0, gm, ("x", "targets"), (), ("__loss__",), (), ())
    counts = tuple(dataclasses.replace(c, stage=0) for c in loss_counts(gm))
    tokens = StepTokens({0: program}, counts, None, 1)
    x, targets = _batch()
    tokens.before_step([{"x": x, "targets": targets}])
    assert float(gm.fxpar_loss_tokens) == float((targets != -100).sum())
    with pytest.raises(ValueError, match="no target of this step's batch counts"):
        tokens.before_step([{"x": x, "targets": torch.full_like(targets, -100)}])
