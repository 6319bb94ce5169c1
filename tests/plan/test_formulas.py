"""Whole-model numbers from the graph against published formulas.

FLOPs per iteration with full activation recomputation, Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters", eq. 3):

    F = 96·B·s·l·h² · (1 + s/(6h) + V/(16·l·h))

(four forward passes of every block — forward, backward at twice the forward, recompute — and
three of the logit layer, which is not recomputed).

Static memory per parameter, Rajbhandari et al. 2020 (ZeRO, section 3.1 and 5.1): mixed-precision
Adam keeps 2 + 2 + K bytes with K = 12; ZeRO stage 1 (P_os) keeps 2 + 2 + K/N_d.
"""
import pytest
import torch

from cost_model.hardware.cluster import get_cluster
from cost_model.layers.memory import TrainingMemory
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from planner.search.costs import ModelCosts
from planner.models.presets import ModelConfig, build_model, get_config

CLUSTER = get_cluster("a100-80g-dgx")

MODELS = {
    "gpt3-175b": get_config("gpt3-175b").with_(attention="math"),
    "small": ModelConfig("gpt", 4, 512, 8, 1000, 512, attention="math", global_batch=8),
}


def _costs(cfg: ModelConfig, dtype=torch.bfloat16, training=None) -> ModelCosts:
    """One block captured on meta; the model has cfg.layers identical ones."""
    model = build_model(cfg.with_(layers=1), device="meta", dtype=dtype)
    tokens = torch.zeros(1, cfg.seq, dtype=torch.long, device="meta")
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    return ModelCosts(capture(model, (tokens, tokens)), cfg.layers, dtype_bytes, training)


def narayanan(cfg: ModelConfig, batch: int) -> float:
    s, l, h, V = cfg.seq, cfg.layers, cfg.hidden, cfg.vocab
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_per_iteration_with_full_recompute_match_narayanan(name):
    cfg = MODELS[name]
    costs = _costs(cfg)
    block = costs.price_block(Strategy(recompute="full"), 1, CLUSTER, 1)
    ends = costs.end_costs(1, CLUSTER)
    ours = cfg.global_batch * (cfg.layers * block.flops + sum(e.flops for e in ends))
    want = narayanan(cfg, cfg.global_batch)
    assert ours == pytest.approx(want, rel=0.02), f"{name}: {ours / want - 1:+.3%}"


@pytest.fixture(scope="module")
def tiny():
    return get_config("gpt-tiny")


def test_default_static_bytes_are_mixed_precision_adam(tiny):
    costs = _costs(tiny)
    cost = costs.price_block(Strategy(), 1, CLUSTER, 1)
    option = costs.block_option(cost)
    assert option.static_bytes == cost.params * (2 + 2 + 12)
    assert option.grad_bytes == cost.params * 2
    assert costs.split_static(option.static_bytes) == (cost.params * 4, cost.params * 12)


def test_fp32_models_default_to_plain_adam(tiny):
    costs = _costs(tiny, dtype=torch.float32)
    cost = costs.price_block(Strategy(), 1, CLUSTER, 1)
    assert costs.block_option(cost).static_bytes == cost.params * (4 + 4 + 8)


@pytest.mark.parametrize("dp", [1, 2, 8, 64])
def test_zero1_partitions_the_optimizer_states_over_dp(tiny, dp):
    costs = _costs(tiny, training=TrainingMemory(zero1=True))
    block = costs.price_block(Strategy(), 1, CLUSTER, 1)
    head = costs.end_costs(1, CLUSTER)[-1]
    assert costs.block_option(block, dp).static_bytes == pytest.approx(
        block.params * (2 + 2 + 12 / dp))
    assert costs.end_layer(head, dp).static_bytes == pytest.approx(head.params * (2 + 2 + 12 / dp))
    weights, opt = costs.split_static(block.params * (4 + 12 / dp), dp)
    assert (weights, opt) == (pytest.approx(block.params * 4), pytest.approx(block.params * 12 / dp))
    # Without ZeRO the data-parallel size changes nothing.
    plain = _costs(tiny)
    assert plain.block_option(block, dp).static_bytes == block.params * 16


@pytest.mark.parametrize("optimizer,master,want", [
    ("adam", True, 2 + 2 + 4 + 8), ("adam", False, 2 + 2 + 8),
    ("sgd", True, 2 + 2 + 4 + 4), ("adafactor", True, 2 + 2 + 4), ("adafactor", False, 2 + 2)])
def test_bytes_per_parameter_by_optimizer(optimizer, master, want):
    assert TrainingMemory(optimizer=optimizer, master_weights=master).per_param() == want


def test_fp32_weights_need_no_master_copy():
    fp32 = TrainingMemory(param_dtype_bytes=4, grad_dtype_bytes=4, master_weights=True)
    assert fp32.per_param() == 4 + 4 + 8
    assert TrainingMemory.for_dtype(4) == TrainingMemory(4, 4, "adam", master_weights=False)


@pytest.mark.parametrize("bad", [dict(optimizer="lion"), dict(param_dtype_bytes=0),
                                 dict(grad_dtype_bytes=True)])
def test_bad_training_memory_is_refused(bad):
    with pytest.raises(ValueError):
        TrainingMemory(**bad)


def test_dp_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="dp"):
        TrainingMemory(zero1=True).optimizer_bytes(0)
