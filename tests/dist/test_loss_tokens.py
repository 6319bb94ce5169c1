"""A mean loss over targets that do not all count (ignore_index), a summed loss, class weights and
label smoothing, trained on real gloo ranks with several micro-batches and replicas: equal to one
process, whose mean is over the whole batch (passes.rewrite.token_mean). Before the rewrite the mean of
the micro-batches' means differed from one process at about 3e-4 on these batches."""

import pytest
import torch

from planner.api import plan
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import HFSpec, assert_same_run, reference_run, run_parallel
from runtime.training.loss_tokens import LOCAL_COUNTS

STEPS = 2


def _ignored(targets: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Targets of which each row ignores a different number (-100, cross-entropy's default)."""
    gen = torch.Generator().manual_seed(seed)
    seq = targets.shape[1]
    keep = torch.arange(seq) >= torch.randint(0, seq // 2, (targets.shape[0], 1), generator=gen)
    return targets.masked_fill(~keep, -100)


class _Preset:
    """A preset model with ignored targets (its forward takes the mean cross-entropy)."""

    def __init__(self, name: str, rows: int = 8):
        self.config, self.rows = get_config(name, layers=2), rows

    def build(self):
        tokens, targets = example_batch(self.config, self.rows)
        return build_model(self.config), (tokens, _ignored(targets))


class TinyLM(torch.nn.Module):
    def __init__(self, loss: torch.nn.Module, vocab: int = 64, hidden: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab)
        self.loss = loss

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.loss(self.head(x).flatten(0, 1), targets.flatten())


class _SummedRegression(torch.nn.Module):
    """Errors of the probabilities against one-hot targets, summed over the batch: by an nn
    module's reduction "sum" (MSELoss), a function's (F.l1_loss) and written out (`.sum()` of
    the rows); beside them a sum that is not over the batch (of the batch's mean per class, as a
    mixture of experts' balance loss sums means over the tokens), which must stay as it is."""

    def __init__(self):
        super().__init__()
        self.squared = torch.nn.MSELoss(reduction="sum")

    def forward(self, logits, targets):
        probs = logits.softmax(-1)
        onehot = torch.nn.functional.one_hot(targets.clamp_min(0), probs.shape[-1]).float()
        absolute = torch.nn.functional.l1_loss(probs, onehot, reduction="sum")
        cubed = (probs - onehot).abs().pow(3).sum()
        batch_mean = (probs * onehot).mean(0).sum()  # a mean over the batch, summed over classes
        return self.squared(probs, onehot) + 0.5 * absolute + 0.25 * cubed - batch_mean


class _Custom:
    """TinyLM with a loss of its own: a sum, a mean with class weights and label smoothing, or
    summed errors other than a cross-entropy."""

    def __init__(self, kind: str):
        self.kind = kind

    def build(self):
        gen = torch.Generator().manual_seed(0)
        if self.kind == "sum":
            loss = torch.nn.CrossEntropyLoss(reduction="sum")
        elif self.kind == "summed-errors":
            loss = _SummedRegression()
        else:
            weight = torch.rand(64, generator=gen) + 0.5
            loss = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
        batch = tuple(torch.randint(0, 64, (8, 8), generator=gen) for _ in "xy")
        return TinyLM(loss), (batch[0], _ignored(batch[1]))


def _train(pool, spec, mesh: dict, vocab_parallel: bool = False, steps: int = STEPS):
    torch.manual_seed(0)
    model, batch = spec.build()
    fix = {"dp": 1, "tp": 1, "cp": 1, "mb": 2, "schedule": "1f1b",
           "strategy": "tp" if mesh.get("tp", 1) > 1 else "none", **mesh}
    chosen = plan(model, 4, batch, cluster="cpu-gloo", fix=fix)[0]
    if vocab_parallel:
        chosen = chosen.with_ends("vocab-tp")
    assert_same_run(run_parallel(spec, chosen, steps, pool), reference_run(spec, steps),
                    what=str(mesh))


@pytest.mark.dist
@pytest.mark.parametrize("mesh", [{"dp": 2, "pp": 2}, {"cp": 2, "pp": 2},
                                  {"tp": 2, "pp": 2}], ids=["dp2-pp2", "cp2-pp2", "tp2-pp2"])
def test_a_mean_over_targets_that_do_not_all_count(pool4, mesh):
    _train(pool4, _Preset("gpt-tiny"), mesh, vocab_parallel="tp" in mesh)


@pytest.mark.dist
def test_counts_summed_by_a_collective_beyond_local_counts(pool4):
    """More replicas' micro-batches than each rank counts itself (loss_tokens.LOCAL_COUNTS):
    the counts are all-reduced over the replicas instead."""
    rows, micro_batch = 16, 1  # dp=2: 2 replicas of 8 micro-batches each
    assert rows // micro_batch > LOCAL_COUNTS  # replicas x micro-batches per replica
    _train(pool4, _Preset("gpt-tiny", rows=rows), {"dp": 2, "pp": 2, "mb": micro_batch})


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["sum", "weighted"])
def test_a_summed_loss_and_a_weighted_smoothed_mean(pool4, kind):
    # A sum's gradients are a batch's worth larger: one SGD step of them already moves every
    # weight far, and a second would compare summation-order noise grown by that step.
    _train(pool4, _Custom(kind), {"dp": 2, "pp": 2}, steps=1 if kind == "sum" else STEPS)


@pytest.mark.dist
@pytest.mark.parametrize("mesh", [{"dp": 2, "pp": 2}, {"dp": 4, "mb": 1}],
                         ids=["dp2-pp2", "dp4-mb1"])
def test_loss_functions_that_sum_train_like_one_process(pool4, mesh):
    """Sums over the batch other than cross-entropy's (passes.rewrite.sum_losses): the trainer's
    average over micro-batches and replicas is undone, as for a summed cross-entropy, and only
    for them. Before, the loss and its gradients came out divided by m·R (4 and 8 here). One
    step, as for the summed cross-entropy above."""
    _train(pool4, _Custom("summed-errors"), mesh, steps=1)


@pytest.mark.dist
def test_a_transformers_model_with_padding_ignored(pool4):
    """The fine-tuning case: padded positions' targets are -100, through loss_fn."""
    spec = HFSpec("llama", global_batch=8, seq=32, extra_inputs=("attention_mask",),
                  ignore_padding=True)
    _train(pool4, spec, {"dp": 2, "pp": 2, "schedule": "zb-h1"})
