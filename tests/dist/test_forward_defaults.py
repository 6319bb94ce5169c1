"""A forward whose parameters after the batch's inputs have defaults (a label smoothing, a flag)
trains at those defaults, as calling it without them does in one process: the capture binds them
as constants (passes.capture.trace._symbolic_trace) instead of leaving inputs no batch gives."""
import pytest
import torch
import torch.nn.functional as F

from planner.api import plan
from planner.training.local import assert_same_run, reference_run, run_parallel

STEPS = 2


class Smoothed(torch.nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens, targets, label_smoothing: float = 0.1, residual: bool = True):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x)) if residual else torch.tanh(block(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten(),
                               label_smoothing=label_smoothing)


class _Spec:
    def build(self):
        gen = torch.Generator().manual_seed(0)
        return Smoothed(), tuple(torch.randint(0, 64, (8, 8), generator=gen) for _ in "xy")


@pytest.mark.dist
def test_defaulted_forward_arguments_train_at_their_defaults_as_one_process(pool2):
    torch.manual_seed(0)
    model, batch = _Spec().build()
    fix = {"dp": 1, "tp": 1, "pp": 2, "mb": 2, "schedule": "1f1b", "strategy": "none"}
    chosen = plan(model, 2, batch, cluster="cpu-gloo", fix=fix)[0]
    assert_same_run(run_parallel(_Spec(), chosen, STEPS, pool2),
                    reference_run(_Spec(), STEPS), what=str(fix))


class _Unread(torch.nn.Module):
    """A model holding a parameter its forward never reads (a table left from an experiment)."""

    def __init__(self):
        super().__init__()
        self.inner = Smoothed()
        self.unread = torch.nn.Parameter(torch.randn(3))

    def forward(self, tokens, targets):
        return self.inner(tokens, targets)


class _UnreadSpec:
    def build(self):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        return _Unread(), tuple(torch.randint(0, 64, (8, 8), generator=gen) for _ in "xy")


@pytest.mark.dist
def test_a_parameter_forward_never_reads_stays_in_the_full_state(pool2):
    """No stage program holds it; the gathered state has it at the model's value, as one
    process leaves it (no gradient, no update)."""
    model, batch = _UnreadSpec().build()
    chosen = plan(model, 2, batch, cluster="cpu-gloo", fix={"dp": 2})[0]
    parallel = run_parallel(_UnreadSpec(), chosen, STEPS, pool2)
    assert "unread" in parallel.state
    assert_same_run(parallel, reference_run(_UnreadSpec(), STEPS), what="dp=2")


class _Outputs(torch.nn.Module):
    """forward returns the loss among other results: first of a tuple, or a dict's "loss"."""

    def __init__(self, kind: str):
        super().__init__()
        self.inner, self.kind = Smoothed(), kind

    def forward(self, tokens, targets):
        x = self.inner.embed(tokens)
        for block in self.inner.blocks:
            x = x + torch.tanh(block(x))
        logits = self.inner.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if self.kind == "dict":
            return {"logits": logits, "loss": loss}
        return loss, logits


class _OutputsSpec:
    def __init__(self, kind: str):
        self.kind = kind

    def build(self):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        return _Outputs(self.kind), tuple(torch.randint(0, 64, (8, 8), generator=gen) for _ in "xy")


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_the_loss_among_other_results_trains_as_one_process(pool2, kind):
    model, batch = _OutputsSpec(kind).build()
    for fix in ({"pp": 2, "mb": 2, "schedule": "1f1b"}, {"dp": 2}):
        chosen = plan(model, 2, batch, cluster="cpu-gloo", fix=fix)[0]
        assert_same_run(run_parallel(_OutputsSpec(kind), chosen, STEPS, pool2),
                        reference_run(_OutputsSpec(kind), STEPS), what=f"{kind} {fix}")
