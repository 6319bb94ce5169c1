"""Alpha-beta collective model and the calibration fit (on synthetic timings)."""

import dataclasses
import random

import pytest

from cost_model.calibration.fitting import fit_alpha_beta, fit_links
from cost_model.hardware.cluster import PRESETS
from cost_model.hardware.comm import (
    KINDS,
    bytes_on_wire,
    collective_time,
    crosses_nodes,
    ring_steps,
    ring_volume,
)

A100 = PRESETS["a100-80g-dgx"]
M = 64 * 2**20


# ---------------------------------------------------------------- ring formulas
@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_ring_volumes_match_published_formulas(n):
    # Thakur et al. 2005 / nccl-tests "bus bandwidth" factors.
    assert ring_volume("all_reduce", M, n) == pytest.approx(2 * (n - 1) / n * M)
    assert ring_volume("all_gather", M, n) == pytest.approx((n - 1) / n * M)
    assert ring_volume("reduce_scatter", M, n) == pytest.approx((n - 1) / n * M)
    assert ring_volume("all_to_all", M, n) == pytest.approx((n - 1) / n * M)
    assert ring_volume("p2p", M, n) == M
    for kind in KINDS:
        assert bytes_on_wire(kind, M, n) == ring_volume(kind, M, n)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_steps(n):
    assert ring_steps("all_reduce", n) == 2 * (n - 1)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert ring_steps(kind, n) == n - 1
    assert ring_steps("p2p", n) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_group_of_one_is_free(kind):
    assert collective_time(A100, kind, M, 1) == 0.0
    assert ring_volume(kind, M, 1) == 0.0


def test_time_is_alpha_beta_formula():
    n = 8
    expected = 2 * (n - 1) * A100.intra_latency + 2 * (n - 1) / n * M / (
        A100.intra_bw * A100.comm_eff)
    assert collective_time(A100, "all_reduce", M, n) == pytest.approx(expected)


def test_bigger_messages_take_longer():
    times = [collective_time(A100, "all_gather", m, 4) for m in (1e3, 1e6, 1e9)]
    assert times == sorted(times) and times[0] < times[-1]


# ---------------------------------------------------------------- intra vs inter
@pytest.mark.parametrize(
    "group_size, stride, inter",
    [
        (8, 1, False),  # tp=8 fills one node
        (4, 2, False),  # span 6 < 8
        (2, 4, False),  # span 4 < 8
        (4, 4, True),  # span 12: leaves the node
        (2, 8, True),  # dp across nodes with tp=8
        (16, 1, True),  # larger than a node
    ],
)
def test_ring_link_selection_by_stride(group_size, stride, inter):
    assert crosses_nodes(A100, "all_reduce", group_size, stride) is inter
    rails = max(1, min(group_size, 8 // stride))  # members per node: one NIC each (DGX)
    if inter:
        alpha, bw = A100.inter_latency, min(rails * A100.inter_bw, A100.intra_bw)
    else:
        alpha, bw = A100.intra_latency, A100.intra_bw
    n = group_size
    expected = (n - 1) * alpha + (n - 1) / n * M / (bw * A100.comm_eff)
    assert collective_time(A100, "all_gather", M, n, stride) == pytest.approx(expected)


def test_a_ring_across_nodes_uses_one_nic_per_member_in_a_node_unless_they_share_one():
    n = 32  # 4 DGX nodes, 8 members in each: 8 NICs per node carry the ring at once
    per_nic = (n - 1) * A100.inter_latency + (n - 1) / n * M / (A100.inter_bw * A100.comm_eff)
    eight = (n - 1) * A100.inter_latency + (n - 1) / n * M / (8 * A100.inter_bw * A100.comm_eff)
    assert collective_time(A100, "all_gather", M, n) == pytest.approx(eight)
    assert collective_time(A100, "all_gather", M, n, stride=8) == pytest.approx(per_nic)
    shared = dataclasses.replace(A100, nic_per_gpu=False)
    assert collective_time(shared, "all_gather", M, n) == pytest.approx(per_nic)


def test_an_all_to_all_across_nodes_sends_its_off_node_share_through_its_own_nic():
    n, k = 64, 8  # 8 nodes of 8: 56/64 of each buffer leaves the node, 7/64 stays on NVLink
    off = (n - k) / n * M / (A100.inter_bw * A100.comm_eff)
    on = (k - 1) / n * M / (A100.intra_bw * A100.comm_eff)
    expected = (n - 1) * A100.inter_latency + max(off, on)
    assert collective_time(A100, "all_to_all", M, n) == pytest.approx(expected)


def test_p2p_crosses_nodes_when_stride_reaches_a_node():
    intra = collective_time(A100, "p2p", M, 2, stride=4)
    inter = collective_time(A100, "p2p", M, 2, stride=8)
    assert intra == pytest.approx(A100.intra_latency + M / (A100.intra_bw * A100.comm_eff))
    assert inter == pytest.approx(A100.inter_latency + M / (A100.inter_bw * A100.comm_eff))


def test_gloo_preset_prices_its_reduce_scatter_as_all_reduce_and_p2p_one_way():
    cpu = PRESETS["cpu-gloo"]
    assert collective_time(cpu, "reduce_scatter", M, 4) == pytest.approx(
        collective_time(cpu, "all_reduce", M, 4))
    assert collective_time(cpu, "p2p", M, 2) == pytest.approx(
        cpu.intra_latency + M / 2 / (cpu.intra_bw * cpu.comm_eff))
    # NCCL keeps the ring formulas.
    assert collective_time(A100, "reduce_scatter", M, 4) < collective_time(A100, "all_reduce", M, 4)


# ---------------------------------------------------------------- per-kind corrections
@pytest.mark.parametrize("name", ["a100-80g-dgx", "h100-sxm-dgx", "h200-sxm-dgx"])
def test_gpu_presets_are_textbook(name):
    cluster = PRESETS[name]
    assert cluster.comm_corrections == ()
    for kind in KINDS:
        assert cluster.comm_correction(kind) == (1.0, 1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_correction_scales_each_term_of_its_kind_only(kind):
    n, lat, bw = 4, 3.0, 0.25
    corrected = dataclasses.replace(A100, comm_corrections={kind: (lat, bw)})
    steps, volume = ring_steps(kind, n), ring_volume(kind, M, n)
    expected = steps * A100.intra_latency * lat + volume / (A100.intra_bw * A100.comm_eff * bw)
    assert collective_time(corrected, kind, M, n) == pytest.approx(expected)
    for other in KINDS:
        if other != kind:
            assert collective_time(corrected, other, M, n) == collective_time(A100, other, M, n)


def test_correction_applies_to_the_inter_node_link_too():
    corrected = dataclasses.replace(A100, comm_corrections={"all_gather": (2.0, 0.5)})
    n = 16
    expected = (n - 1) * A100.inter_latency * 2.0 + (n - 1) / n * M / (
        A100.inter_bw * A100.comm_eff * 0.5)
    # one member per node (stride 8): the ring runs on one NIC
    assert collective_time(corrected, "all_gather", M, n, stride=8) == pytest.approx(expected)
    # The traffic accounting stays the textbook volume.
    assert bytes_on_wire("all_gather", M, n) == pytest.approx((n - 1) / n * M)


@pytest.mark.parametrize(
    "args, match",
    [
        (("broadcast", M, 4), "kind"),
        (("all_reduce", -1.0, 4), "nbytes"),
        (("all_reduce", float("nan"), 4), "nbytes"),
        (("all_reduce", M, 0), "group"),
        (("all_reduce", M, 2.5), "group"),
    ],
)
def test_bad_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        collective_time(A100, *args)


def test_bad_stride_raises():
    with pytest.raises(ValueError, match="stride"):
        collective_time(A100, "all_reduce", M, 4, stride=0)


# ---------------------------------------------------------------- calibration fit
def _synthetic(alpha, bw, noise=0.0, seed=0):
    rng = random.Random(seed)
    samples = []
    for n in (2, 4):
        for kind in KINDS:
            for size in (4e3, 64e3, 1e6, 4e6, 16e6):
                steps, vol = ring_steps(kind, n), ring_volume(kind, size, n)
                t = (steps * alpha + vol / bw) * (1 + rng.uniform(-noise, noise))
                samples.append((steps, vol, t))
    return samples


def test_fit_recovers_alpha_and_bw_exactly():
    alpha, bw = fit_alpha_beta(_synthetic(50e-6, 2e9))
    assert alpha == pytest.approx(50e-6, rel=1e-6)
    assert bw == pytest.approx(2e9, rel=1e-6)


def test_fit_tolerates_noise():
    alpha, bw = fit_alpha_beta(_synthetic(200e-6, 1e9, noise=0.1, seed=3))
    assert alpha == pytest.approx(200e-6, rel=0.15)
    assert bw == pytest.approx(1e9, rel=0.15)


def test_fit_with_no_latency_keeps_alpha_non_negative():
    alpha, bw = fit_alpha_beta(_synthetic(0.0, 5e9))
    assert 0.0 <= alpha < 1e-9
    assert bw == pytest.approx(5e9, rel=1e-4)


def test_fit_needs_data():
    with pytest.raises(ValueError):
        fit_alpha_beta([(1, 1e6, 1e-3)])


def test_fit_links_recovers_both_link_classes():
    truth = dataclasses.replace(
        PRESETS["cpu-gloo"], gpus_per_node=2, intra_latency=100e-6, intra_bw=2e9,
        inter_latency=400e-6, inter_bw=0.5e9, comm_eff=1.0, comm_corrections=())
    measurements = [
        (kind, n, size, collective_time(truth, kind, size, n))
        for n in (2, 4) for kind in KINDS for size in (4096, 2**20, 2**24)
    ]
    fields = fit_links(truth, measurements)
    assert fields["intra_latency"] == pytest.approx(100e-6, rel=1e-4)
    assert fields["intra_bw"] == pytest.approx(2e9, rel=1e-4)
    assert fields["inter_latency"] == pytest.approx(400e-6, rel=1e-4)
    assert fields["inter_bw"] == pytest.approx(0.5e9, rel=1e-4)
    assert fields["comm_eff"] == 1.0
    for kind in KINDS:  # the textbook truth needs no corrections
        assert fields["comm_corrections"][kind] == pytest.approx((1.0, 1.0), rel=1e-3)


def test_fit_links_recovers_per_kind_corrections():
    corrections = {"all_gather": (1.5, 0.8), "reduce_scatter": (2.0, 0.5),
                   "all_to_all": (0.5, 0.7), "p2p": (0.3, 2.0)}
    truth = dataclasses.replace(
        PRESETS["cpu-gloo"], gpus_per_node=2, intra_latency=200e-6, intra_bw=1e9,
        inter_latency=800e-6, inter_bw=0.6e9, comm_eff=1.0, comm_corrections=corrections)
    measurements = [
        (kind, n, size, collective_time(truth, kind, size, n))
        for n in (2, 4) for kind in KINDS for size in (4096, 2**16, 2**20, 2**24)
    ]
    fields = fit_links(truth, measurements)
    # all_reduce is the reference: the links are its alpha and bw.
    assert fields["intra_latency"] == pytest.approx(200e-6, rel=1e-4)
    assert fields["inter_bw"] == pytest.approx(0.6e9, rel=1e-4)
    assert fields["comm_corrections"]["all_reduce"] == (1.0, 1.0)
    for kind, pair in corrections.items():
        assert fields["comm_corrections"][kind] == pytest.approx(pair, rel=1e-3)
    fitted = dataclasses.replace(truth, **fields)
    for kind, n, size, seconds in measurements:
        assert collective_time(fitted, kind, size, n) == pytest.approx(seconds, rel=1e-3)


def test_expert_dispatch_across_nodes_sends_each_token_once_per_other_node():
    from cost_model.hardware.comm import expert_dispatch_time
    tokens, k, nbytes, ep = 4096, 8, 7168 * 2, 64   # 8 nodes of 8
    nodes = 8
    remote = (nodes - 1) * (1 - (1 - 1 / nodes) ** k)
    nic = tokens * remote * nbytes / (A100.inter_bw * A100.comm_eff)
    nvlink = tokens * k * nbytes * (ep - 1) / ep / (A100.intra_bw * A100.comm_eff)
    expected = A100.inter_latency + A100.intra_latency + max(nic, nvlink)
    assert expert_dispatch_time(A100, tokens, k, nbytes, ep) == pytest.approx(expected)
    # fewer bytes on the NIC than the flat all-to-all's 56/64 of every copy
    assert expected < collective_time(A100, "all_to_all", tokens * k * nbytes, ep)
    # inside a node: the all-to-all of the top-k copies
    assert expert_dispatch_time(A100, tokens, k, nbytes, 8) == pytest.approx(
        collective_time(A100, "all_to_all", tokens * k * nbytes, 8))


# ------------------------------------------------- group-limited expert dispatch
def _sampled_remote_nodes(experts, groups, topk_groups, k, nodes, tokens=20000, seed=0):
    """Brute force: random router scores through runtime.experts.dispatch.route (DeepSeek-V3's
    sigmoid, group-limited choice), each token on a random node of `nodes` holding consecutive
    experts; the mean number of other nodes its experts lie on."""
    import torch

    from runtime.experts.dispatch import route
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    _, _, index = route(logits, k, "sigmoid", True, 1.0, groups, topk_groups)
    hit = torch.zeros(tokens, nodes).scatter_(1, index // (experts // nodes), 1)
    home = torch.randint(0, nodes, (tokens, 1), generator=gen)
    return float((hit.sum(1) - hit.gather(1, home).squeeze(1)).mean())


@pytest.mark.parametrize("experts,groups,topk_groups,k,nodes,tol", [
    (256, 8, 4, 8, 8, 0.02),    # DeepSeek-V3 over 8 nodes: one group per node
    (256, 8, 4, 8, 4, 0.02),    # groups smaller than nodes: 2 per node
    (256, 8, 4, 8, 2, 0.02),    # 4 per node
    (32, 4, 2, 8, 2, 0.02),     # deepseek-tiny's routing, 2 groups per node
    (256, 16, 4, 8, 8, 0.02),
    (256, 8, 4, 4, 8, 0.06),    # k = g: chosen groups go unhit, the unlimited bound binds
    (256, 8, 6, 8, 8, 0.06),
])
def test_group_limited_remote_nodes_bound_the_sampled_routing(experts, groups, topk_groups, k,
                                                              nodes, tol):
    from cost_model.hardware.comm import remote_nodes
    sampled = _sampled_remote_nodes(experts, groups, topk_groups, k, nodes)
    priced = remote_nodes(nodes, k, groups, topk_groups)
    assert sampled * 0.99 <= priced <= sampled * (1 + tol)   # 0.99: sampling noise
    assert priced <= remote_nodes(nodes, k)       # never more than without the limit


def test_groups_wider_than_nodes_keep_the_unlimited_formula():
    from cost_model.hardware.comm import remote_nodes
    # 8 groups over 16 nodes: a group spans 2 nodes; the unlimited count bounds the routing
    assert remote_nodes(16, 8, 8, 4) == remote_nodes(16, 8) == pytest.approx(
        15 * (1 - (15 / 16) ** 8))
    assert _sampled_remote_nodes(256, 8, 4, 8, 16) < remote_nodes(16, 8)
    assert remote_nodes(8, 8, 1, 1) == remote_nodes(8, 8, 8, 8) == remote_nodes(8, 8)


def test_group_limited_dispatch_sends_each_token_to_at_most_its_groups_nodes():
    from cost_model.hardware.comm import expert_dispatch_time
    tokens, k, nbytes, ep = 4096, 8, 7168 * 2, 64   # 8 nodes of 8, a group of 32 experts per node
    remote = 4 * 7 / 8                               # its 4 groups' nodes, 7/8 of them others
    nic = tokens * remote * nbytes / (A100.inter_bw * A100.comm_eff)
    nvlink = tokens * k * nbytes * (ep - 1) / ep / (A100.intra_bw * A100.comm_eff)
    expected = A100.inter_latency + A100.intra_latency + max(nic, nvlink)
    limited = expert_dispatch_time(A100, tokens, k, nbytes, ep, group_limit=(8, 4))
    assert limited == pytest.approx(expected)
    assert limited < expert_dispatch_time(A100, tokens, k, nbytes, ep)
    # inside a node the limit changes nothing: every token still sends its k copies
    assert expert_dispatch_time(A100, tokens, k, nbytes, 8, group_limit=(8, 4)) == \
        expert_dispatch_time(A100, tokens, k, nbytes, 8)


# ------------------------------------------------- dispatch fan-out: routing and deduplication
def _brute_fanout(experts, k, ep, members, choose, tokens):
    """Brute force: for each token (its experts from `choose`) and each source rank, the other
    ranks and other nodes its experts lie on; the means over tokens and sources."""
    per_rank, ranks, nodes = experts // ep, 0, 0
    for t in range(tokens):
        held = {e // per_rank for e in choose(t)}
        for source in range(ep):
            ranks += len(held - {source})
            nodes += len({r // members for r in held} - {source // members})
    return ranks / (tokens * ep), nodes / (tokens * ep)


@pytest.mark.parametrize("experts,k,ep,gpus_per_node", [
    (256, 8, 64, 8),    # DeepSeek-V3 under EP 64: a token's 8 experts on 2 neighbouring ranks
    (384, 8, 32, 8),    # Kimi K2 under EP 32: 12 experts a rank, 1 or 2 ranks a token
    (128, 4, 64, 8),    # GPT-OSS 120B under EP 64
    (128, 8, 8, 8),     # Qwen3-30B-A3B inside a node
])
def test_round_robin_fanout_counts_the_gates_pattern(experts, k, ep, gpus_per_node):
    from cost_model.hardware.comm import dispatch_fanout
    hw = dataclasses.replace(A100, gpus_per_node=gpus_per_node, round_robin_routing=True,
                             dispatch_per_rank=True)
    rr = lambda t: [(t * k + j) % experts for j in range(k)]  # noqa: E731
    ranks, nodes = _brute_fanout(experts, k, ep, gpus_per_node, rr, experts)
    copies, remote = dispatch_fanout(hw, ep, 1, k, experts)
    assert (copies, remote) == pytest.approx((ranks, nodes))
    # per routed slot without deduplication; the nodes are the pattern's all the same
    plain = dataclasses.replace(hw, dispatch_per_rank=False)
    assert dispatch_fanout(plain, ep, 1, k, experts) == pytest.approx((k * (ep - 1) / ep, nodes))


def test_deduplicated_uniform_fanout_matches_sampled_routing():
    import random

    from cost_model.hardware.comm import dispatch_fanout, remote_nodes
    experts, k, ep = 256, 8, 64
    rng = random.Random(0)
    hw = dataclasses.replace(A100, dispatch_per_rank=True)
    ranks, _ = _brute_fanout(experts, k, ep, 8, lambda t: rng.sample(range(experts), k), 3000)
    copies, remote = dispatch_fanout(hw, ep, 1, k, experts)
    assert copies == pytest.approx(ranks, rel=0.01)
    assert copies < k * (ep - 1) / ep                # fewer copies than slots
    assert remote == remote_nodes(8, k)              # the nodes as without deduplication


def test_round_robin_dispatch_is_cheaper_than_uniform_routing_across_nodes():
    from cost_model.hardware.comm import expert_dispatch_time
    deepep = dataclasses.replace(A100, dispatch_per_rank=True)
    gate = dataclasses.replace(deepep, round_robin_routing=True)
    args = (4096, 8, 7168 * 2, 64)
    # DeepSeek-V3's 8 experts of a token reach 2 neighbouring ranks on one node, not 4.6 nodes
    assert expert_dispatch_time(gate, *args, experts=256) < \
        expert_dispatch_time(deepep, *args, experts=256) / 4
    # deduplication spares NVLink copies; across nodes the NIC's copies set the time here
    assert expert_dispatch_time(deepep, *args, experts=256) <= expert_dispatch_time(A100, *args)
