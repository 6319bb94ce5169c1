"""Recording a mixture-of-experts layer's routing and replaying it (runtime.experts.routing_log):
what a dry run routes when it is set beside a measured run."""
import pytest
import torch

from runtime.experts import routing_log
from runtime.experts.dispatch import moe_ffn


def _call(tokens=12, h=8, f=16, experts=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, h, generator=g)
    router = torch.randn(experts, h, generator=g)
    w = [torch.randn(experts, f, h, generator=g), torch.randn(experts, f, h, generator=g),
         torch.randn(experts, h, f, generator=g)]
    return moe_ffn(x, router, *w, top_k=k)[0], x, router


def test_a_real_call_records_its_counts_per_expert():
    with routing_log.recording() as log:
        _call(seed=1)
        _call(seed=2)
    assert len(log) == 2
    for sent, got in log:
        assert sum(sent) == 12 * 2 and len(sent) == 4
        assert got == (sent,)          # one rank: it receives what it sends
    with routing_log.recording() as again:
        _call(seed=1)
    assert again[0] == log[0]          # routing is the values': the same inputs, the same counts


def test_even_routing_spreads_slots_and_gives_each_rank_its_experts_share():
    sent, got = routing_log.even(10, 4, 2, me=1)
    assert sent == (3, 3, 2, 2)
    assert got == ((2, 2), (2, 2))


def test_replay_returns_the_recording_in_order_and_refuses_a_mismatch():
    log = [((3, 1), ((3, 1),)), ((0, 4), ((0, 4),))]
    with routing_log.replaying(log):
        assert routing_log.dry_routing(4, 2, 1, 0) == log[0]
        assert routing_log.dry_routing(4, 2, 1, 0) == log[1]
        with pytest.raises(RuntimeError, match="more mixture-of-experts calls"):
            routing_log.dry_routing(4, 2, 1, 0)
    with pytest.raises(RuntimeError, match="routed 1 mixture-of-experts calls where the "
                                           "recorded run routed 2"):
        with routing_log.replaying(log):
            routing_log.dry_routing(4, 2, 1, 0)
    with pytest.raises(RuntimeError, match="routes 6 rows over 2 experts"):
        with routing_log.replaying(log):
            routing_log.dry_routing(6, 2, 1, 0)
    # Without a recording a dry run routes evenly.
    with routing_log.replaying(()):
        assert routing_log.dry_routing(4, 2, 1, 0) == ((2, 2), ((2, 2),))
