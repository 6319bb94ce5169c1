"""A tied head on another stage than the embedding is priced: both hold the weight and the
all-reduce summing its gradients over their two ranks is on the critical path (runtime.training.tied)."""
import pytest

from cost_model.hardware.cluster import get_cluster
from cost_model.hardware.comm import collective_time
from planner.api import plan
from planner.models.presets import get_config

FIX = {"tp": 4, "dp": 4, "mb": 1, "strategy": "tp", "schedule": "1f1b"}


@pytest.mark.parametrize("pp", [1, 4])
def test_tied_head_adds_the_gradient_sum_across_the_end_stages(pp):
    untied, tied = (plan(get_config("gpt2-small", tie=t), 16 * pp, cluster="a100-80g-dgx",
                         fix={**FIX, "pp": pp})[0] for t in (False, True))
    extra = tied.predicted.iteration_s - untied.predicted.iteration_s
    if pp == 1:  # one stage holds one tensor: held, summed over dp and stepped once
        assert extra <= 1e-12
        assert tied.predicted.peak_memory_bytes < untied.predicted.peak_memory_bytes
        return
    config = get_config("gpt2-small")
    vocab_parallel = "vocab-tp" in tied.stages[0].strategies
    grad_bytes = config.vocab * config.hidden * 2 / (4 if vocab_parallel else 1)  # bf16
    expected = collective_time(get_cluster("a100-80g-dgx"), "all_reduce", grad_bytes, 2,
                               stride=(pp - 1) * 4 * 4)
    assert extra == pytest.approx(expected, rel=1e-6)
