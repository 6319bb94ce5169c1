"""Capture finds the blocks of models whose blocks differ, groups them into runs of identical
blocks, and the planner prices each kind and lays the runs out in contiguous stages."""
import pytest
import torch
import torch.nn.functional as F

from passes.capture.block_runs import block_runs
from passes.capture.trace import capture
from planner.api import plan
from planner.search.costs import ModelCosts, PlanningError
from planner.models.mixed import MixedSpec, parse_block
from planner.models.presets import get_config

BASE = get_config("llama-tiny").with_(layers=1, hidden=32, heads=4, kv_heads=2, vocab=61, seq=8)


class Experts(torch.nn.Module):
    """A block holding a longer ModuleList (experts) than the model's list of blocks."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(6))

    def forward(self, x):
        return x + sum(e(x) for e in self.experts) / len(self.experts)


class ExpertModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16), Experts(), Experts()])
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_the_outermost_list_is_the_blocks_even_when_an_experts_list_is_longer():
    tokens = torch.randint(0, 32, (1, 8))
    captured = capture(ExpertModel(), (tokens, tokens))
    assert [b.name for b in captured.blocks] == ["layers.0", "layers.1", "layers.2"]
    assert [(r.kind, r.first, r.count) for r in block_runs(captured.blocks)] == [(0, 0, 1),
                                                                                (1, 1, 2)]


def test_runs_of_an_alternating_pattern():
    spec = MixedSpec(BASE, ("gpt:32", "llama:32", "gpt:32", "llama:32", "llama:32"))
    model, batch = spec.build()
    captured = capture(model, tuple(x[:1] for x in batch))
    runs = [(r.kind, r.count) for r in block_runs(captured.blocks)]
    assert runs == [(0, 1), (1, 1), (0, 1), (1, 2)]
    assert ModelCosts(captured, 5, 4).block_sequence == (0, 1, 0, 1, 1)


def test_stages_follow_the_blocks_and_each_kind_is_priced_on_its_own():
    """Four narrow blocks and four 512 times as wide on two stages: the wide blocks cost
    more, so the stage holding them holds fewer blocks; the layers stay in model order."""
    spec = MixedSpec(BASE, ("llama:16",) * 4 + ("llama:8192",) * 4)
    model, batch = spec.build()
    chosen = plan(model, 2, example_inputs=batch, cluster="cpu-gloo",
                  fix={"pp": 2, "dp": 1, "tp": 1, "schedule": "1f1b", "mb": 1})[0]
    layers = [layer for st in chosen.stages for layer in st.layers]
    assert layers == ["embed"] + [f"blocks.{i}" for i in range(8)] + ["head"]
    first, second = (sum(l.startswith("blocks") for l in st.layers) for st in chosen.stages)
    assert first > second
    captured = capture(model, tuple(x[:1] for x in batch))
    costs = ModelCosts(captured, 8, 4)
    from cost_model.hardware.cluster import get_cluster
    from cost_model.layers.strategy import Strategy
    narrow, wide = (costs.price_block(Strategy(), 1, get_cluster("cpu-gloo"), 1, kind=k)
                    for k in (0, 1))
    assert wide.params > 50 * narrow.params and wide.fwd_s > 2 * narrow.fwd_s


def test_stated_runs_extend_a_capture_of_one_block_per_kind():
    spec = MixedSpec(BASE, ("llama:16", "llama:64"))
    model, batch = spec.build()
    captured = capture(model, tuple(x[:1] for x in batch))
    costs = ModelCosts(captured, 7, 4, runs=((0, 3), (1, 4)))
    assert costs.block_sequence == (0, 0, 0, 1, 1, 1, 1)
    with pytest.raises(PlanningError, match="capture every block or pass runs="):
        ModelCosts(captured, 7, 4)
    with pytest.raises(PlanningError, match=r"counts >= 1 summing to the 7 blocks"):
        ModelCosts(captured, 7, 4, runs=((0, 3), (1, 3)))
    with pytest.raises(PlanningError, match=r"kinds in 0..1"):
        ModelCosts(captured, 7, 4, runs=((0, 3), (2, 4)))


def test_block_texts_are_checked():
    assert parse_block("gpt:128") == ("gpt", 128)
    with pytest.raises(ValueError, match="ARCH:FFN_WIDTH"):
        parse_block("mamba:12")


class DataDependent(torch.nn.Module):
    """A block whose shapes follow a tensor's values (an expert's token count)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            keep = int((x[..., 0] > 0).sum().item())
            x = block(x)[..., :max(keep, 1)].sum(-1, keepdim=True) + x
        return F.cross_entropy(x.flatten(0, 1), targets.flatten())


def test_a_data_dependent_shape_is_refused_with_the_module_the_line_and_the_fix():
    from passes.capture.trace import CaptureError
    tokens = torch.randint(0, 16, (1, 8))
    with pytest.raises(CaptureError) as caught:
        capture(DataDependent(), (tokens, tokens))
    message = str(caught.value)
    assert "\n" not in message
    assert "item" in message and ".item()" in message and "compute such sizes" in message


def test_a_stated_layout_of_mixed_blocks_is_priced_per_kind_as_the_search_priced_it():
    """The search's plan, priced again as a stated layout, predicts the same time; moving one
    wide block to the other stage changes it, so the kinds are told apart."""
    from planner.interop.configuration import Configuration, Pricer
    spec = MixedSpec(BASE, ("llama:16",) * 3 + ("llama:8192",) * 3)
    model, batch = spec.build()
    pricer = Pricer(model, 2, batch, cluster="cpu-gloo")
    best = pricer.best(fix={"pp": 2, "dp": 1, "tp": 1, "schedule": "1f1b", "mb": 1})[0]
    config = Configuration.of(best)
    again = pricer.price(config)
    assert again.iteration_s == pytest.approx(best.predicted.iteration_s, rel=1e-9)
    sizes = [len(stage) for stage in config.stages]
    moved = (("none",) * (sizes[0] - 1), ("none",) * (sizes[1] + 1))
    other = pricer.price(Configuration(1, 1, 2, 1, 1, "1f1b", 1, moved, ends=config.ends))
    assert other.iteration_s != pytest.approx(again.iteration_s, rel=1e-6)


def test_a_long_alternating_pattern_is_described_by_counts():
    from types import SimpleNamespace

    from passes.capture.block_runs import describe
    blocks = [SimpleNamespace(signature=str(i % 2), nodes=(0,) * (2 + i % 2), name=f"blocks.{i}")
              for i in range(8)]
    assert describe(blocks) == ("8 blocks in 8 runs: 4 of kind 0 (first block blocks.0, "
                                "2 nodes), 4 of kind 1 (first block blocks.1, 3 nodes)")


def test_a_kind_says_how_its_ops_differ_from_the_first_kind_of_its_part():
    """The plan's note names what makes a kind other: the ops it has more or fewer of than the
    first kind of its part, or that only shapes or constants differ."""
    from types import SimpleNamespace as NS

    import torch

    from passes.capture.block_runs import describe
    ops = {"a": torch.relu, "b": torch.nn.functional.linear, "c": torch.nn.functional.linear,
           "d": torch.tanh}
    graph = {name: NS(op="call_function", target=fn) for name, fn in ops.items()}
    blocks = [NS(signature="x", nodes=("a",), name="blocks.0"),
              NS(signature="y", nodes=("b", "c", "d"), name="blocks.1"),
              NS(signature="z", nodes=("a",), name="blocks.2")]
    assert describe(blocks, graph) == (
        "block 0 (kind 0, 1 node), block 1 (kind 1, 3 nodes; beside kind 0: +linear x2, "
        "+tanh, -relu), block 2 (kind 2, 1 node; the ops of kind 0 on other shapes or "
        "constants)")
    # a preset captures one block per kind and states its runs: spans count the model's blocks
    assert describe(blocks[:2], graph, counts=((0, 3), (1, 5))) == (
        "blocks 0-2 (kind 0, 1 node), blocks 3-7 (kind 1, 3 nodes; beside kind 0: +linear x2, "
        "+tanh, -relu)")
