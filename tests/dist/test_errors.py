"""Errors that need a real launch."""
import pytest

from planner.api import autoparallelize
from planner.models.presets import build_model, example_batch, get_config


def _mismatched_world():
    config = get_config("gpt-tiny")
    model = build_model(config)
    try:
        autoparallelize(model, gpus=8, example_inputs=example_batch(config, 16))
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.dist
def test_world_size_different_from_gpus(pool2):
    messages = pool2.run(_mismatched_world)
    for message in messages:
        assert "autoparallelize(gpus=8)" in message and "2 processes" in message
