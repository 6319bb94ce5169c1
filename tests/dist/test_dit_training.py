"""A diffusion transformer (planner.models.dit's dit-tiny, every weight random so that every
gradient is non-zero from the first step) trains on 4 gloo ranks as in one process - the losses
of every step, every gradient, the final parameters, rtol 1e-5 - under tp=2 x pp=2, tp=2 x dp=2
with and without sequence parallelism, and pp=2 x dp=2, its cross-attention variant under
tp=2 (sequence parallel) x pp=2; and under tp the bytes its block sends are the bytes the cost
model prices, the modulation's all-gather among them."""
import pytest
import torch

from tests.harness.traffic import block_traffic
from planner.api import plan
from planner.models.presets import get_config
from planner.training.local import assert_same_run, reference_run, run_parallel
from runtime.comm.wire import bytes_on_wire

SPEC = get_config("dit-tiny").with_(zero_init=False, global_batch=8)
STEPS = 3
MESHES = {
    "tp2-pp2": {"tp": 2, "pp": 2, "dp": 1, "strategy": "tp"},
    "tp2-dp2": {"tp": 2, "dp": 2, "pp": 1, "strategy": "tp"},
    "tp2-dp2-sp": {"tp": 2, "dp": 2, "pp": 1, "strategy": "tp+sp"},
    "pp2-dp2": {"pp": 2, "dp": 2, "tp": 1},
}
_REFERENCE = {}


def _reference():
    if "run" not in _REFERENCE:
        _REFERENCE["run"] = reference_run(SPEC, STEPS)
    return _REFERENCE["run"]


@pytest.mark.dist
def test_the_cross_attention_variant_trains_like_one_process(pool4):
    """Every block also cross-attends to a conditioning sequence, carried between the stages
    beside the hidden state and the conditioning vector: tp=2 with sequence parallelism x pp=2."""
    spec = get_config("dit-tiny-cross").with_(zero_init=False, global_batch=8)
    fix = {"tp": 2, "pp": 2, "dp": 1, "strategy": "tp+sp", "mb": 2, "schedule": "1f1b"}
    chosen = plan(spec, 4, cluster="cpu-gloo", fix=fix)[0]
    blocks = [s for st in chosen.stages for layer, s in zip(st.layers, st.strategies)
              if layer.startswith("blocks.")]
    assert blocks == ["tp+sp"] * spec.layers
    assert_same_run(run_parallel(spec, chosen, STEPS, pool4), reference_run(spec, STEPS))


@pytest.mark.dist
@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_trains_like_one_process(pool4, mesh):
    fix = {**MESHES[mesh], "mb": 2, "schedule": "1f1b"}
    chosen = plan(SPEC, 4, cluster="cpu-gloo", fix=fix)[0]
    assert (chosen.tp, chosen.pp, chosen.dp) == (fix["tp"], fix["pp"], fix["dp"])
    if chosen.tp > 1:  # every block tensor-parallel (sequence parallel too, where asked)
        blocks = [s for st in chosen.stages for layer, s in zip(st.layers, st.strategies)
                  if layer.startswith("blocks.")]
        assert blocks == [fix["strategy"]] * SPEC.layers
    assert_same_run(run_parallel(SPEC, chosen, STEPS, pool4), _reference(), what=mesh)


@pytest.mark.dist
def test_a_block_sends_what_is_priced(pool4):
    """Per block under tp=2: the attention's and the MLP's all-reduces ([mb, patches, hidden],
    one each way), the modulation's input gradient all-reduced backward ([mb, hidden]) and its
    [mb, 6 x hidden] output all-gathered forward; counted on the wire and priced alike."""
    mb, h, tp = 2, SPEC.hidden, 2
    sent, priced = pool4.run(block_traffic, SPEC, tp, mb)[0]
    reduce = bytes_on_wire("all_reduce", 4 * (4 * mb * SPEC.seq * h + mb * h), tp)
    gather = bytes_on_wire("all_gather", 4 * mb * 6 * h, tp)
    for block, counted in sent.items():
        assert counted == priced[block] == {"all_reduce": reduce, "all_gather": gather}, block
