"""Hugging Face models built from configs, trained on 8 gloo ranks against one process."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.api import plan  # noqa: E402
from planner.training.local import HFSpec, assert_same_run, build, reference_run, run_parallel  # noqa: E402,E501

CASES = [("gpt2", {"dp": 2, "tp": 2, "pp": 2}), ("llama", {"dp": 2, "tp": 2, "pp": 2}),
         ("gpt2", {"dp": 1, "tp": 4, "pp": 2}), ("llama", {"dp": 1, "tp": 2, "pp": 4})]


@pytest.mark.dist
@pytest.mark.parametrize("arch,mesh", CASES)
def test_hf_model_matches_one_process(pool8, arch, mesh):
    layers = max(2, mesh["pp"])  # a block a stage: what a mesh tests does not grow with depth
    depth = "num_hidden_layers" if arch == "llama" else "n_layer"
    spec = HFSpec(arch, overrides=((depth, layers),))
    torch.manual_seed(0)
    model, batch = build(spec)
    chosen = plan(model, 8, batch, cluster="cpu-gloo",
                  fix={**mesh, "mb": 2, "strategy": "tp", "schedule": "1f1b"})[0]
    assert (chosen.dp, chosen.tp, chosen.pp) == (mesh["dp"], mesh["tp"], mesh["pp"])
    parallel = run_parallel(spec, chosen, 3, pool8)
    reference = reference_run(spec, 3)
    assert_same_run(parallel, reference)
