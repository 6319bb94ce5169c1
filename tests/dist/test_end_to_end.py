"""Forced plans on 8 real gloo ranks against one process: losses and gradients of every step,
final parameters."""
import pytest

from planner.api import plan
from planner.models import get_config
from planner.train import assert_same_run, reference_run, run_parallel

MESHES = [(1, 1, 8), (1, 8, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)]  # (dp, tp, pp)
STEPS = 3


@pytest.mark.dist
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dp,tp,pp", MESHES)
def test_forced_plan_matches_one_process(pool8, model, dp, tp, pp):
    config = get_config(model)
    # Pipelines need many micro-batches; without one, fewer keep the tp=8 collectives cheap.
    mb = 1 if pp > 1 else 2
    chosen = plan(config, 8, cluster="cpu-gloo",
                  fix={"dp": dp, "tp": tp, "pp": pp, "mb": mb, "strategy": "tp"})[0]
    assert (chosen.dp, chosen.tp, chosen.pp) == (dp, tp, pp)
    if tp > 1:
        assert any("tp" in s for st in chosen.stages for s in st.strategies)
    parallel = run_parallel(config, chosen, STEPS, pool8)
    reference = reference_run(config, STEPS)
    assert_same_run(parallel, reference)
