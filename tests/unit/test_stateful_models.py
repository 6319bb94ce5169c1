"""What a model's forward may do that parallel training would not repeat as one process does is
refused at capture, naming the module or buffer and the source line: BatchNorm's batch
statistics, a buffer updated in forward, a result besides the loss that is not a tensor
(passes.capture.unsupported). The capture leaves the user's model as it was."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.capture.trace import CaptureError, capture


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class Counter(Block):
    def __init__(self, d=8):
        super().__init__(d)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return super().forward(x)


class EMA(Block):
    def __init__(self, d=8):
        super().__init__(d)
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return super().forward(x)


class BN(Block):
    def __init__(self, d=8):
        super().__init__(d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.fc(self.bn(x))


class Keeps(Block):
    def forward(self, x):
        self.last = x  # a plain attribute set in forward: the captured graph does not set it
        return super().forward(x)


class Features(nn.Module):
    """Feature vectors [batch, din] -> classes; its blocks are `block`."""

    def __init__(self, block=Block, layers=2, d=8):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(layers))
        self.out = nn.Linear(d, 3)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(h), y)


class CountsToo(Features):
    def forward(self, x, y):
        return super().forward(x, y), x.shape[0]


def _batch(n=4):
    return torch.randn(n, 4), torch.randint(0, 3, (n,))


def _refusal(model) -> str:
    with pytest.raises(CaptureError) as err:
        capture(model, _batch(1))
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_a_buffer_updated_in_place_in_forward_is_refused_naming_it_and_its_line():
    model = Features(Counter)
    message = _refusal(model)
    for words in ("updates buffer 'blocks.0.seen'", "add_",
                  "test_stateful_models.py:", "`self.seen += x.shape[0]`",
                  "once per micro-batch on every data-parallel rank", "outside forward"):
        assert words in message, message
    # the trace assigned its traced value to the attribute: put back, the buffer untouched
    assert type(model.blocks[0].seen) is torch.Tensor and model.blocks[0].seen.item() == 0


def test_an_ema_buffer_updated_under_no_grad_is_refused_naming_it():
    message = _refusal(Features(EMA))
    assert "updates buffer 'blocks.0.ema'" in message, message
    assert "`self.ema.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)`" in message, message


def test_batchnorm_in_training_mode_is_refused_for_its_batch_statistics():
    message = _refusal(Features(BN))
    for words in ("blocks.0.bn (BatchNorm1d)", "statistics of the batch",
                  "one micro-batch on each data-parallel rank", "LayerNorm or GroupNorm",
                  "blocks.0.bn.eval()"):
        assert words in message, message


def test_batchnorm_with_frozen_statistics_captures():
    model = Features(BN)
    for block in model.blocks:
        block.bn.eval()  # running statistics, not the batch's: the same under every plan
    assert len(capture(model, _batch(1)).blocks) == 2


def test_a_result_besides_the_loss_that_is_not_a_tensor_is_refused():
    message = _refusal(CountsToo())
    for words in ("CountsToo.forward returns an int as result 1",
                  "`return super().forward(x, y), x.shape[0]`", "as tensors",
                  "train_step returns the loss alone"):
        assert words in message, message


def test_an_attribute_set_in_forward_is_put_back_and_warned_of():
    model = Features(Keeps)
    with pytest.warns(UserWarning, match="sets blocks.0.last, blocks.1.last to computed"):
        captured = capture(model, _batch(1))
    assert not hasattr(model.blocks[0], "last")  # not an fx.Proxy left in the user's model
    assert len(captured.blocks) == 2


def test_a_functional_batch_norm_in_training_mode_is_refused_naming_its_line():
    class Functional(Block):
        def forward(self, x):  # batch statistics without a BatchNorm module
            return x + self.fc(F.batch_norm(x, None, None, training=True))

    message = _refusal(Features(Functional))
    for words in ("normalises with batch statistics", "F.batch_norm(x, None, None, training=True)",
                  "LayerNorm or GroupNorm"):
        assert words in message, message


def test_one_sample_failing_in_a_batch_statistic_says_the_capture_runs_one_sample():
    from passes.capture.capture_errors import hint as _hint
    hint = _hint(ValueError("Expected more than 1 value per channel when training, got input "
                            "size torch.Size([1, 32])"))
    for words in ("captures the model with one sample",
                  "needs more than one sample in training mode", "LayerNorm or GroupNorm"):
        assert words in hint, hint
