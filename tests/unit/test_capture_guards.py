"""Guards against silently wrong training that need no ranks: the captured output must be a scalar
loss (or loss_fn= makes it one), tied parameters are found at capture."""
import pytest
import torch
import torch.nn.functional as F

from passes.capture.trace import CaptureError, capture
from planner.api import plan
from planner.models.presets import build_model, example_batch, get_config


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x)


class LogitsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(2))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_forward_returning_logits_is_refused_naming_loss_fn():
    tokens = torch.randint(0, 32, (4, 8))
    with pytest.raises(CaptureError, match=r"shape \[1, 8, 32\], not a scalar loss.*loss_fn="):
        plan(LogitsModel(), 2, (tokens,), cluster="cpu-gloo")


def test_loss_fn_makes_the_loss_and_keeps_the_model_and_its_names():
    model, tokens = LogitsModel(), torch.randint(0, 32, (4, 8))
    from planner.models.loss import with_loss
    wrapped = with_loss(model, _loss)
    assert dict(wrapped.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert wrapped.head.weight is model.head.weight
    torch.testing.assert_close(wrapped(tokens, tokens), _loss(model(tokens), tokens))
    chosen = plan(model, 2, (tokens, tokens), cluster="cpu-gloo", loss_fn=_loss)[0]
    assert chosen.gpus == 2


def test_loss_fn_with_a_preset_is_refused():
    with pytest.raises(ValueError, match="loss_fn= applies to a model given as an nn.Module"):
        plan("gpt-tiny", 2, cluster="cpu-gloo", loss_fn=_loss)


def test_tied_parameters_are_found_at_capture():
    config = get_config("gpt-tiny", tie=True, layers=2)
    captured = capture(build_model(config), tuple(x[:1] for x in example_batch(config, 1)))
    assert captured.tied == (("wte.weight", "lm_head.weight"),)
    untied = get_config("gpt-tiny", layers=2)
    assert capture(build_model(untied), example_batch(untied, 1)).tied == ()


class ParentResidual(torch.nn.Module):
    """Blocks whose residual add is written in the parent's loop."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return _loss(self.head(x), targets)


def test_ops_between_blocks_go_with_the_block_before_and_uneven_blocks_are_planned():
    """The last residual add falls after the last block, so blocks.2 differs from the others:
    two runs of blocks of two kinds, planned, and the plan's note says so."""
    tokens = torch.randint(0, 32, (4, 8))
    captured = capture(ParentResidual(), (tokens[:1], tokens[:1]))
    layer_of = captured.layer_of()
    assert layer_of["add"] == "blocks.0" and layer_of["add_1"] == "blocks.1"
    chosen = plan(ParentResidual(), 2, (tokens, tokens), cluster="cpu-gloo")[0]
    assert any("blocks 0-1 (kind 0, 2 nodes), block 2 (kind 1, 1 node; beside kind 0: -add)"
               in n
               for n in chosen.notes)


class ReadsEmbeddingInHead(torch.nn.Module):
    """Ties the head to the embedding by reading its weight (F.linear(x, wte.weight))."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(Residual() for _ in range(2))

    def forward(self, tokens, targets):
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x)
        return _loss(F.linear(x, self.wte.weight), targets)


def test_a_weight_two_stages_read_is_read_by_each_not_sent():
    from passes.stages.program import Layout, rank_programs
    tokens = torch.randint(0, 32, (2, 8))
    captured = capture(ReadsEmbeddingInHead(), (tokens, tokens))
    programs = rank_programs(captured, Layout(1, (), (2, 2)), 0, (0, 1))
    assert all(p.shared_params == ("wte.weight",) for p in programs.values())
    last = programs[1]
    assert "wte.weight" in dict(last.gm.named_parameters())
    assert all(spec.shape != (32, 16) for spec in last.input_specs)  # no weight on the wire


class UnderscoredList(torch.nn.Module):
    """Blocks in a list whose name holds "_" (diffusers' transformer_blocks, SD3's joint_blocks)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
        self.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block in self.transformer_blocks:
            x = x + block(x)
        return _loss(self.head(x), targets)


def test_a_list_of_blocks_whose_name_holds_an_underscore_is_found():
    tokens = torch.randint(0, 32, (4, 8))
    captured = capture(UnderscoredList(), (tokens[:1], tokens[:1]))
    assert [b.name for b in captured.blocks] == [f"transformer_blocks.{i}" for i in range(3)]


class ValueBranch(torch.nn.Module):
    """A block whose Python reads a tensor's value: a branch, or a size from .item()."""
    def __init__(self, kind):
        super().__init__()
        self.fc, self.kind = torch.nn.Linear(16, 16), kind

    def forward(this, x):  # (not named self: the line is found by the module it runs on)
        if this.kind == "branch":
            if x.sum() > 0:
                x = x * 2
        else:
            x = x + int(x.abs().max().item())
        return x + this.fc(x)


@pytest.mark.parametrize("kind, line", [("branch", "`if x.sum() > 0:`"),
                                        ("item", "`x = x + int(x.abs().max().item())`")])
def test_a_value_dependent_capture_names_the_users_line_without_torchs_text(kind, line,
                                                                               capfd):
    model = LogitsModel()
    model.blocks[1] = ValueBranch(kind)
    with pytest.raises(CaptureError) as err:
        capture(model, (torch.randint(0, 32, (2, 8)),))
    message = str(err.value)
    assert f"in module 'blocks.1', at {line} (test_capture_guards.py:" in message
    assert "a tensor's values decide a shape or a branch there" in message
    for torch_text in ("forward_call", "Eq(", "u0", "tlparse", "symbolic_trace failed too"):
        assert torch_text not in message
    assert "symbolic_shapes" not in capfd.readouterr().err  # torch's warning is not printed
