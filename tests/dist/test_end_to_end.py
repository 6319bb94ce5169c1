"""Forced plans on 8 real gloo ranks against one process: losses and gradients of every step,
final parameters."""
import pytest

from planner.api import plan
from planner.models.presets import get_config
from planner.training.local import assert_same_run, reference_run, run_parallel

MESHES = [(1, 1, 8), (1, 8, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)]  # (dp, tp, pp)
STEPS = 3


@pytest.mark.dist
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dp,tp,pp", MESHES)
def test_forced_plan_matches_one_process(pool8, model, dp, tp, pp):
    # two blocks without a pipeline (one hand-over between blocks), four or one a stage with
    # one: what a mesh tests does not grow with depth, and on two cores every block costs each
    # tp rank its collectives
    config = get_config(model, layers=max(4, pp) if pp > 1 else 2)
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


def _train_and_close(plan_json: str) -> tuple[float, bool]:
    import torch.distributed as dist

    from planner.api import ParallelModel
    from planner.models.presets import build_model, example_batch
    from planner.search.plan import Plan
    from planner.training.local import make_optimizer
    config = get_config("gpt-tiny", layers=2)
    batch = example_batch(config, 8)
    pm = ParallelModel(build_model(config), Plan.from_json(plan_json), [], batch, make_optimizer)
    loss = pm.train_step(*batch)
    pm.close()
    return loss, dist.is_initialized()


@pytest.mark.dist
def test_close_ends_the_run_on_every_rank():
    """ParallelModel.close() frees the shard and destroys the process groups on every rank (the
    launcher, finding none left, does not destroy them twice)."""
    from runtime.launch.ranks import run_local
    config = get_config("gpt-tiny", layers=2)
    chosen = plan(config, 2, cluster="cpu-gloo", global_batch=8,
                  fix={"dp": 2, "tp": 1, "pp": 1, "mb": 1})[0]
    results = run_local(_train_and_close, 2, (chosen.dumps(),))
    assert [initialized for _, initialized in results] == [False, False]
    assert results[0][0] == results[1][0]
