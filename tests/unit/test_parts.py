"""A model's parts: the outermost lists of blocks that run one after the other make one chain of
blocks; lists whose blocks interleave do not (the longest is split, the plan says so); a user
names the parts to split with `parts=` / `fxpar_parts`."""
import pytest
import torch
from torch import nn

from passes.capture.block_runs import part_labels
from passes.capture.trace import CaptureError, capture
from planner.api import plan


class _Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _TwoParts(nn.Module):
    """A tower of 3 blocks, then a decoder of 2; `interleave` runs them alternately instead."""

    def __init__(self, interleave: bool = False):
        super().__init__()
        self.embed, self.interleave = nn.Embedding(32, 16), interleave
        self.tower = nn.ModuleList(_Block() for _ in range(3))
        self.decoder = nn.ModuleList(_Block() for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))  # bare layers: no part
        self.out = nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        if self.interleave:
            for a, b in zip(self.tower, self.decoder):
                x = b(a(x))
        else:
            for block in self.tower:
                x = block(x)
            x = self.heads[0](x) + self.heads[1](x)
            for block in self.decoder:
                x = block(x)
        return nn.functional.cross_entropy(self.out(x).flatten(0, 1), targets.flatten())


BATCH = (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))


def test_lists_that_run_one_after_the_other_are_parts_of_one_chain():
    captured = capture(_TwoParts(), tuple(x[:1] for x in BATCH))
    assert captured.parts == ("tower", "decoder")
    assert [l.name for l in captured.layers] == ["embed", "tower.0", "tower.1", "tower.2",
                                                  "decoder.0", "decoder.1", "head"]
    # the bare linears between the parts read the tower's output: they go with its last block
    owner = captured.layer_of()
    assert {owner[n.name] for n in captured.gm.graph.nodes
            if n.op == "call_module" and n.target.startswith("heads")} == {"tower.2"}


def test_interleaved_lists_are_not_parts_and_the_plan_says_so():
    model = _TwoParts(interleave=True)
    assert capture(model, tuple(x[:1] for x in BATCH)).parts == ("tower",)
    chosen = plan(model, 2, BATCH, cluster="cpu-gloo")[0]
    assert any(n.startswith("only tower is split") and "decoder (2 x _Block)" in n
               for n in chosen.notes)


def test_the_parts_a_user_names_are_split_and_a_wrong_name_is_refused():
    model = _TwoParts()
    model.fxpar_parts = ("decoder",)
    captured = capture(model, tuple(x[:1] for x in BATCH))
    assert [l.name for l in captured.blocks] == ["decoder.0", "decoder.1"]
    with pytest.raises(CaptureError, match=r"'towr' is not an nn.ModuleList \(or nn.Sequential "
                                           r"of blocks\) of _TwoParts; its lists of layers "
                                           r"are tower, decoder, heads"):
        capture(model, tuple(x[:1] for x in BATCH), parts=("towr",))


def test_parts_are_labelled_by_the_first_component_of_their_paths_that_differs():
    assert part_labels(["model.vision.encoder.layers", "model.text.layers"]) == {
        "model.vision.encoder.layers": "vision", "model.text.layers": "text"}
    assert part_labels(["blocks"]) == {"blocks": "blocks"}
    assert part_labels(["a.layers", "a.layers2"]) == {"a.layers": "layers",
                                                      "a.layers2": "layers2"}
