"""CUDA checks: skipped without a GPU (run them on a GPU machine with `pytest -m gpu`)."""
import pytest
import torch

from passes.capture.trace import capture
from passes.stages.program import Layout, rank_programs
from planner.models.presets import build_model, example_batch, get_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_stage_programs_on_cuda_match_the_model(name):
    config = get_config(name)
    torch.manual_seed(0)
    model = build_model(config, device="cuda")
    tokens, targets = example_batch(config, 4, device="cuda")
    expected = model(tokens, targets)
    captured = capture(model, (tokens, targets))
    sizes = (3, 4, 3)  # embed + 2 blocks | 4 blocks | 2 blocks + head
    programs = rank_programs(captured, Layout(1, (), sizes), 0, (0, 1, 2))
    values = programs[0].gm(tokens)
    values = programs[1].gm(*values)
    loss = programs[2].gm(*values, targets)
    torch.testing.assert_close(loss, expected)
