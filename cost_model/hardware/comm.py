"""Alpha-beta (latency-bandwidth) times for ring collectives.

    time = steps * alpha + volume / (bw * comm_eff)

`volume` is what each rank sends over its link in a bandwidth-optimal ring
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH", 2005; the same counts nccl-tests uses to turn time
into "bus bandwidth"). With n ranks and a tensor of M bytes:

    all_reduce      2(n-1)/n * M   in 2(n-1) steps (reduce-scatter + all-gather)
    all_gather       (n-1)/n * M   in  n-1 steps   (M = gathered output)
    reduce_scatter   (n-1)/n * M   in  n-1 steps   (M = input)
    all_to_all       (n-1)/n * M   in  n-1 steps   (M = per-rank buffer)
    p2p                      M     in  1 step

Ranks are numbered tp innermost, then cp, dp, pp, and consecutive members of
a group sit `stride` ranks apart. A group whose span fits inside one node
uses the NVLink numbers; otherwise ring hops cross the network. On a
rail-optimised GPU node (DGX: one InfiniBand NIC per GPU, `nic_per_gpu`)
NCCL runs one ring channel per NIC, so a group with k members in each node
crosses the network on k NICs at once and its ring moves at
min(k * inter_bw, intra_bw) (k = 1 for a group one GPU per node, such as
data parallel with tp = 8). An all-to-all cannot share NICs that way — every
GPU's bytes for other nodes are its own — so its (n - k)/n share for other
nodes goes through the GPU's own NIC while the (k - 1)/n share for its own
node goes over NVLink at the same time:

    all_to_all across nodes   max((n-k)/n * M / inter_bw, (k-1)/n * M / intra_bw)

Libraries do not all run the textbook ring, so each kind's two terms may
carry a measured multiplier, `Cluster.comm_correction(kind)`:

    time = steps * alpha * latency + volume / (bw * comm_eff * bandwidth)

Both default to 1 (the GPU presets keep the textbook model); `fxpar
calibrate` fits them from timings of each kind, with all_reduce as the
reference that defines alpha and bw. On CPU (gloo over loopback TCP) they
are far from 1 and for reasons that are known:
- reduce_scatter_tensor is an all-reduce of a copy followed by taking this
  rank's chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced): about
  twice the ring's latency and volume;
- all_to_all posts every pairwise exchange at once rather than n-1 ring
  steps;
- the "link" is the cores copying bytes through the kernel. Ring ranks send
  and receive at once, each side of a p2p transfer does one of the two, and a
  p2p message skips the collective's hand-off to gloo's worker thread, so
  p2p has both a far smaller latency and a larger bandwidth.
"""

from __future__ import annotations

import functools
import math

from runtime.comm.wire import KINDS, check_count, check_kind, bytes_on_wire, ring_volume

from cost_model.hardware.cluster import Cluster

__all__ = [
    "KINDS",
    "collective_time",
    "collective_terms",
    "link",
    "ring_steps",
    "ring_volume",
    "bytes_on_wire",
    "crosses_nodes",
    "members_per_node",
    "expert_dispatch_time",
    "remote_nodes",
    "dispatch_fanout",
]

def ring_steps(kind: str, n: int) -> int:
    """Sequential message steps (each paying one alpha) for n ranks."""
    check_kind(kind)
    check_count("group size", n)
    if n == 1:
        return 0
    if kind == "p2p":
        return 1
    if kind == "all_reduce":
        return 2 * (n - 1)
    return n - 1


def crosses_nodes(cluster: Cluster, kind: str, group_size: int, stride: int = 1) -> bool:
    """Whether the group's ring (or the p2p pair) leaves a node."""
    check_kind(kind)
    check_count("group_size", group_size)
    check_count("stride", stride)
    if kind == "p2p":
        return stride >= cluster.gpus_per_node
    return (group_size - 1) * stride >= cluster.gpus_per_node


def collective_terms(
    cluster: Cluster, kind: str, nbytes: float, group_size: int, stride: int = 1
) -> tuple[int, float, bool]:
    """(ring steps, per-rank ring volume, crosses_nodes): the textbook terms,
    before the per-kind corrections. Calibration fits against these."""
    crosses = crosses_nodes(cluster, kind, group_size, stride)
    return ring_steps(kind, group_size), ring_volume(kind, nbytes, group_size), crosses


def link(cluster: Cluster, crosses: bool) -> tuple[float, float]:
    """(alpha, achieved bandwidth) of the link class a ring runs over, one NIC per ring."""
    if crosses:
        return cluster.inter_latency, cluster.inter_bw * cluster.comm_eff
    return cluster.intra_latency, cluster.intra_bw * cluster.comm_eff


def members_per_node(cluster: Cluster, group_size: int, stride: int = 1) -> int:
    """Members of a group that share a node (ranks `stride` apart, nodes gpus_per_node wide)."""
    if stride >= cluster.gpus_per_node:
        return 1
    return max(1, min(group_size, cluster.gpus_per_node // stride))


def _seconds_per_byte(cluster: Cluster, kind: str, n: int, stride: int, crosses: bool) -> float:
    """Seconds per byte of ring volume: the link, with a rail-optimised node's NICs in parallel
    for a ring, and an all-to-all's own-NIC and NVLink shares at once (module doc)."""
    _, bw = link(cluster, crosses)
    if not (crosses and cluster.nic_per_gpu) or kind == "p2p":
        return 1.0 / bw
    k = members_per_node(cluster, n, stride)
    intra = cluster.intra_bw * cluster.comm_eff
    if kind != "all_to_all":
        return 1.0 / min(k * bw, intra)
    # per byte of the (n-1)/n ring volume: the off-node share on the NIC, the rest on NVLink
    return max((n - k) / bw, (k - 1) / intra) / (n - 1)


def collective_time(
    cluster: Cluster, kind: str, nbytes: float, group_size: int, stride: int = 1
) -> float:
    """Seconds for one `kind` collective over `group_size` ranks; see module doc
    for what `nbytes` means per kind. Inside a training step a collective also pays
    `cluster.collective_handoff` (calibrated; 0 in the presets): its ranks come to it from
    computing, not from the previous collective."""
    steps, volume, crosses = collective_terms(cluster, kind, nbytes, group_size, stride)
    if steps == 0:
        return 0.0
    alpha, _ = link(cluster, crosses)
    latency, bandwidth = cluster.comm_correction(kind)
    per_byte = _seconds_per_byte(cluster, kind, group_size, stride, crosses)
    return steps * alpha * latency + volume * per_byte / bandwidth + cluster.collective_handoff


def expert_dispatch_time(cluster: Cluster, tokens: float, top_k: int, token_bytes: float,
                         ep: int, stride: int = 1,
                         group_limit: tuple[int, int] = (1, 1), experts: int = 0) -> float:
    """Seconds of one expert-parallel dispatch (or combine) of a rank's `tokens`, each to top_k
    of `experts` experts spread evenly over the ep ranks of its group (`stride` apart);
    group_limit = (n, g): the router keeps each token's experts within its g best of n groups of
    consecutive experts (DeepSeek-V3's group-limited routing, (8, 4); (1, 1): no limit).

    What a token puts on the links is `dispatch_fanout`'s: its copies for other GPUs (one per
    routed slot, or one per destination GPU where the kernel deduplicates,
    `Cluster.dispatch_per_rank`) and the other nodes it reaches. Inside a node it is the
    all-to-all of those copies. Across rail-optimised nodes it runs hierarchically, as DeepEP's
    internode kernels do: a token crosses the network once for each other node that holds one
    of its experts (to the GPU of the same rail there), and NVLink fans it out to that node's
    experts. Its own NIC carries the copies for other nodes while NVLink carries the copies
    that change GPU (both at once)."""
    if ep == 1:
        return 0.0
    copies, remote = dispatch_fanout(cluster, ep, stride, top_k, experts, group_limit)
    crosses = crosses_nodes(cluster, "all_to_all", ep, stride)
    if not (crosses and cluster.nic_per_gpu):
        # the all-to-all moves (ep - 1)/ep of its buffer: the buffer whose share is `copies`
        buffer = tokens * copies * token_bytes * ep / (ep - 1)
        return collective_time(cluster, "all_to_all", buffer, ep, stride)
    latency, bandwidth = cluster.comm_correction("all_to_all")
    nic = tokens * remote * token_bytes / (cluster.inter_bw * cluster.comm_eff)
    nvlink = tokens * copies * token_bytes / (cluster.intra_bw * cluster.comm_eff)
    alpha = (cluster.inter_latency + cluster.intra_latency) * latency
    return alpha + max(nic, nvlink) / bandwidth + cluster.collective_handoff


def dispatch_fanout(cluster: Cluster, ep: int, stride: int, top_k: int, experts: int = 0,
                    group_limit: tuple[int, int] = (1, 1)) -> tuple[float, float]:
    """(copies of a token that leave its GPU, other nodes it reaches), on average over tokens
    and source ranks, for the routing and dispatch kernel the cluster names:

    - routing: uniform (each token's top_k distinct experts at random: real routers under a
      balance loss) or, with `Cluster.round_robin_routing`, token t on experts tk ... tk + k - 1
      mod E (the fake balanced gate benchmarks run: NeMo AutoModel's FakeBalancedGate), whose
      consecutive experts sit on one or two neighbouring ranks;
    - copies: one per routed slot on another rank, k (ep - 1)/ep (an all-to-all of permuted
      slots: fxpar's runtime, Megatron's all-to-all dispatcher), or with
      `Cluster.dispatch_per_rank` one per other destination GPU (DeepEP sends a token once to
      each rank holding any of its experts).

    Under uniform routing a rank of L = E/ep experts holds none of a token's k with chance
    C(E - L, k)/C(E, k), so a token reaches (ep - 1)(1 - that) other ranks ((1 - 1/ep)^k when E
    is not known), and `remote_nodes` other nodes. Under round-robin routing the ranks and nodes
    a token reaches are counted over one period of the pattern (E / gcd(E, k) tokens); every
    rank sends its token t to the same ranks, so a source is one of a token's R ranks with
    chance R/ep and the others number R (ep - 1)/ep (nodes likewise)."""
    members = members_per_node(cluster, ep, stride)
    nodes = ep / members
    if cluster.round_robin_routing and experts:
        ranks, hit_nodes = _round_robin_reach(experts, top_k, ep, members)
        slots = top_k * (ep - 1) / ep
        copies = ranks * (ep - 1) / ep if cluster.dispatch_per_rank else slots
        return copies, hit_nodes * (nodes - 1) / nodes
    remote = remote_nodes(nodes, top_k, *group_limit)
    if not cluster.dispatch_per_rank:
        return top_k * (ep - 1) / ep, remote
    if experts:
        missed = math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k)
    else:
        missed = (1 - 1 / ep) ** top_k
    return (ep - 1) * (1 - missed), remote


@functools.lru_cache(maxsize=None)   # a pure function of four counts, asked once per block price
def _round_robin_reach(experts: int, top_k: int, ep: int, members: int) -> tuple[float, float]:
    """(ranks, nodes) token t's experts tk ... tk + k - 1 (mod E) lie on, averaged over one
    period of t; ranks hold E/ep consecutive experts, nodes `members` consecutive ranks."""
    period = experts // math.gcd(experts, top_k)
    per_rank = experts // ep
    ranks = nodes = 0
    for t in range(period):
        held = {(t * top_k + j) % experts // per_rank for j in range(top_k)}
        ranks += len(held)
        nodes += len({r // members for r in held})
    return ranks / period, nodes / period


def remote_nodes(nodes: float, top_k: int, groups: int = 1, topk_groups: int = 1) -> float:
    """The other nodes a token's top_k experts reach on average, its EP group on `nodes` nodes N
    of E/N consecutive experts each, under balanced routing:

        (N − 1) · (1 − q),   q = the chance a given other node holds none of its experts

    Without a limit the k experts fall (nearly) independently and uniformly: q = (1 − 1/N)^k.

    With the limit (n groups of E/n consecutive experts, g of them per token) the groups map onto
    nodes when each group lies within one node: node j holds experts [jE/N, (j+1)E/N) (the
    group's ranks are consecutive, E/ep experts each, ep/N of them per node), group i holds
    [iE/n, (i+1)E/n), and every group falls inside one node iff a node's range is a whole
    number of groups: E/N a multiple of E/n, i.e. N whole and dividing n (c = n/N groups per
    node). A token then reaches the nodes of its chosen groups only. Those g groups are uniform
    among the n (balanced routing), and each holds one of its k experts or more: the group score
    is the sum of a group's two best affinities, so a chosen group's best expert nearly always
    makes the top k when k >= 2g (DeepSeek-V3: k = 8, g = 4). The chance that a given node holds
    none of the h = min(g, k) groups hit is then hypergeometric:

        q_groups = C(n − c, h) / C(n, h)     (c = 1: q_groups = 1 − h/n, remote = h (N − 1)/N)

    Both q's are lower bounds of the true miss chance: fewer than h groups may be hit (k near g),
    and the limit only concentrates a token's experts, which leaves more nodes unhit than
    unlimited routing does. The tighter, q = max(q_groups, (1 − 1/N)^k), is taken: remote is an
    upper bound within a few per cent of the routing's (tests/unit/test_comm.py samples
    runtime.experts.dispatch.route over random router scores: DeepSeek-V3 at N = 8 reaches 3.50
    other nodes against a sampled 3.46, 4.59 without the limit). Groups wider than a node (N not
    dividing n) spread a group over several nodes, outside this model: the unlimited formula, an
    upper bound there too, is kept."""
    unlimited = (1 - 1 / nodes) ** top_k
    if not groups_within_nodes(nodes, groups, topk_groups):
        return (nodes - 1) * (1 - unlimited)
    nodes, per_node = int(nodes), groups // int(nodes)
    hit = min(topk_groups, top_k)
    missed = math.comb(groups - per_node, hit) / math.comb(groups, hit)
    return (nodes - 1) * (1 - max(missed, unlimited))


def groups_within_nodes(nodes: float, groups: int, topk_groups: int) -> bool:
    """Whether a group limit binds (topk_groups < groups) and every group of consecutive experts
    lies within one of `nodes` equal nodes of consecutive experts: N whole and dividing n."""
    whole = float(nodes).is_integer() and nodes >= 1
    return topk_groups < groups and whole and groups % int(nodes) == 0
