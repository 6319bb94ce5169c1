"""Models whose blocks are not all alike, planned and trained under tp=2 x pp=2 on real gloo
ranks against one process: losses, every gradient of every step, final parameters."""
import pytest

from planner.api import plan
from planner.models.mixed import MixedSpec
from planner.models.presets import get_config
from planner.training.local import assert_same_run, reference_run, run_parallel

BASE = get_config("llama-tiny").with_(layers=1, hidden=64, heads=4, kv_heads=2, vocab=97, seq=16)
CASES = {
    "wide then narrow": ("llama:128", "llama:128", "llama:64", "llama:64"),
    "alternating": ("gpt:64", "llama:96", "gpt:64", "llama:96"),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", CASES)
def test_heterogeneous_blocks_train_like_one_process(pool4, name):
    spec = MixedSpec(BASE, CASES[name], global_batch=8)
    model, batch = spec.build()
    chosen = plan(model, 4, example_inputs=batch, cluster="cpu-gloo",
                  fix={"dp": 1, "tp": 2, "pp": 2, "mb": 2, "schedule": "1f1b", "strategy": "tp"})[0]
    blocks = [layer for st in chosen.stages for layer in st.layers if layer.startswith("blocks")]
    assert blocks == [f"blocks.{i}" for i in range(4)]
    assert all(len(st.layers) > 1 for st in chosen.stages)
    assert any("kinds" in note for note in chosen.notes)
    assert_same_run(run_parallel(spec, chosen, 3, pool4), reference_run(spec, 3), what=name)
