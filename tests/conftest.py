"""Shared fixtures: pools of real gloo ranks, started once per test session and reused."""
import pytest
import torch

from runtime.launch.ranks import RankPool

_POOLS: dict[int, RankPool] = {}


def rank_pool(world_size: int) -> RankPool:
    """The session's pool of `world_size` ranks; a pool a failed test closed is started again."""
    if world_size not in _POOLS or not _POOLS[world_size].alive:
        _POOLS[world_size] = RankPool(world_size, timeout_s=120)
    return _POOLS[world_size]


@pytest.fixture
def pool8():
    return rank_pool(8)


@pytest.fixture
def pool4():
    return rank_pool(4)


@pytest.fixture
def pool2():
    return rank_pool(2)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
