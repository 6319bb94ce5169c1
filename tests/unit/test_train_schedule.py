"""The learning-rate schedule (planner.training.schedule), AdamW's parameter groups
(planner.training.optimizer) and the forward-only schedule evaluation runs
(runtime.training.evaluate)."""
import math

import pytest
import torch

from planner.models.presets import build_model, get_config
from planner.training.config import from_dict
from planner.training.optimizer import build, embedding_names, kind, param_groups, set_lr
from planner.training.schedule import LRSchedule
from runtime.pipeline.generators import make_schedule
from runtime.pipeline.schedule import Kind
from runtime.training.evaluate import forward_schedule


def test_warmup_then_cosine_to_min_lr():
    s = LRSchedule(1e-3, warmup_steps=10, decay="cosine", decay_steps=90, min_lr=1e-4)
    assert s(1) == pytest.approx(1e-4) and s(5) == pytest.approx(5e-4)
    assert s(10) == pytest.approx(1e-3)
    assert s(55) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(100) == pytest.approx(1e-4) and s(500) == pytest.approx(1e-4)
    assert all(s(i) >= s(i + 1) for i in range(10, 120))


def test_linear_and_constant():
    lin = LRSchedule(2.0, warmup_steps=0, decay="linear", decay_steps=4, min_lr=0.0)
    assert [lin(i) for i in range(1, 6)] == pytest.approx([1.5, 1.0, 0.5, 0.0, 0.0])
    const = LRSchedule(2.0, warmup_steps=2, decay="constant")
    assert [const(i) for i in range(1, 5)] == [1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="steps count from 1"):
        const(0)
    with pytest.raises(ValueError, match="decay must be one of"):
        LRSchedule(1.0, decay="step")


def test_schedule_from_config_decays_until_the_last_step():
    c = from_dict({"model": {"preset": "llama-tiny"}, "data": {"path": "d"},
                   "optimizer": {"lr": 1e-3}, "training": {"steps": 50},
                   "lr_schedule": {"warmup_steps": 10, "min_lr": 1e-5}})
    s = LRSchedule.of(c)
    assert s.decay_steps == 40 and s(50) == pytest.approx(1e-5) and s(10) == pytest.approx(1e-3)


def _config(**optimizer):
    return from_dict({"model": {"preset": "llama-tiny"}, "data": {"path": "d"},
                      "optimizer": optimizer})


def test_weight_decay_leaves_out_norms_biases_and_embeddings():
    model = build_model(get_config("gpt-tiny").with_(layers=1), device="meta")
    embeddings = embedding_names(model)
    assert embeddings == {"wte.weight", "wpe.weight"}
    named = list(model.named_parameters())
    kinds = {n: kind(n, p, embeddings) for n, p in named}
    assert kinds["blocks.0.ln1.weight"] == "norm" and kinds["blocks.0.ln1.bias"] == "bias"
    assert kinds["wte.weight"] == "embedding" and kinds["blocks.0.fc1.weight"] == "weight"
    decay, keep = param_groups(named, embeddings, _config().optimizer)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    weights = {id(p) for n, p in named if kinds[n] == "weight"}
    assert ids(decay["params"]) == weights and decay["weight_decay"] == 0.1
    assert keep["weight_decay"] == 0.0 and len(keep["params"]) == len(named) - len(weights)
    every = _config(decay_norms=True, decay_biases=True, decay_embeddings=True).optimizer
    decay, keep = param_groups(named, embeddings, every)
    assert len(decay["params"]) == len(named) and keep["params"] == []


def test_the_optimizer_and_its_rate():
    params = [torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3))]
    opt = build(params, _config(betas=[0.8, 0.9], eps=1e-6).optimizer)
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups) == 2
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["eps"] == 1e-6
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    sgd = build(params, _config(name="sgd", momentum=0.5).optimizer)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("zb-h1", 2, 4, 1),
                                        ("interleaved-1f1b", 2, 4, 2), ("gpipe", 3, 3, 1)])
def test_the_forward_schedule_keeps_forwards_in_order(name, p, m, v):
    train = make_schedule(name, p, m, v)
    fwd = forward_schedule(train)
    for rank, row in enumerate(fwd.actions):
        assert all(a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F) for a in row)
        assert list(row) == [a for a in train.actions[rank] if a in set(row)]
        assert sum(a.kind is Kind.F for a in row) == m * v
