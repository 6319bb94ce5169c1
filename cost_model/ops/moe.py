"""Cost of a mixture-of-experts layer (one runtime.experts.dispatch.moe_ffn node): compute per token,
all-to-all bytes, the router's load imbalance, expert weights per rank, dispatched activations.

Per micro-batch of T tokens, hidden h, E experts of SwiGLU width f, top k, dtype of d bytes
(f read from the expert weights' layout: gate_up [E, 2f, h], or [E, h, 2f] for GPT-OSS):

  router FLOPs      2 T h E                      (forward; backward twice that, as every matmul)
  expert FLOPs      6 T k h f                    (three matmuls per routed slot), on the most
                                                 loaded EP rank times the imbalance factor
  dispatched rows   T k                          each of h values; the runtime keeps, per slot,
                                                 the expert input (h), the gate and up outputs,
                                                 their SwiGLU product and its silu (4 f), the
                                                 expert output that the routing weight scales
                                                 (h) and the scaled output, which index_add's
                                                 backward keeps for its shape (h):
                                                 T k (3h + 4f) d bytes saved; under expert
                                                 parallelism the combine's received rows too,
                                                 T k h d more (ExpertPricing)
  router saved      2 T E d                      (scores and their softmax / sigmoid)
  all-to-all bytes  4 T k h d r                  per micro-batch on each rank: dispatch and
                                                 combine forward, both again in backward; r is
                                                 the fraction of slots routed to other ranks,
                                                 (ep - 1) / ep for uniform routing. What
                                                 runtime.experts.dispatch counts (kind "all_to_all") is
                                                 2 (S_out + S_in) h d for the S_out slots a rank
                                                 sends to other ranks' experts and the S_in it
                                                 receives: the same bytes with T k r = the mean
                                                 of the two (tests/dist/test_expert_parallel.py).
  expert weights    (3 E h f + B) d / ep         per rank (and their gradients and optimizer
                                                 states, as for any weight); B the experts'
                                                 bias values, E (2f + h) for GPT-OSS, else 0
                                                 (their adds are not counted in the FLOPs)
  balance stats     2 b E d                      under context parallelism, per micro-batch of
                                                 b sequences: the balance loss's expert counts
                                                 and score sums, all-reduced over the cp group
                                                 forward and (their gradient) backward
                                                 (`balance_bytes`; priced by layer_cost.price)

Imbalance: with uniform random routing, each token puts k distinct experts among E; the slots an
EP rank of E/ep experts receives from N tokens have mean N k / ep and, per token, the
hypergeometric variance k (L/E)(1 - L/E)(E - k)/(E - 1), L = E/ep. The ep loads sum to N k, so
they are exchangeable with correlation -1/(ep - 1); their expected maximum is
mean + sigma * sqrt(ep/(ep - 1)) * E[max of ep standard normals] (`expected_max_load`; the
normal approximation is checked against sampling in tests/unit/test_moe_costs.py). The factor is
that maximum over the mean; `--moe-imbalance` overrides it.

Group limit: the facts carry the router's groups and groups per token (DeepSeek-V3's 8 and 4;
1, 1 without a limit), from moe_ffn's `groups` / `topk_groups` keywords or the routed_experts op's
trailing arguments of the same names (planner.models.hf_moe reads them off transformers' router).
They leave the bytes above alone (every slot still moves) and lower the dispatch's network share
across nodes, priced by cost_model.hardware.comm.expert_dispatch_time.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from cost_model.ops.graph_facts import BWD_FACTOR, Call, OpCost, finish, nbytes, tensor_of
from runtime.experts.custom_op import arguments as op_arguments

QUALNAME = "runtime.experts.dispatch.moe_ffn"
OP_QUALNAME = "torch._ops.fxpar.fxpar::routed_experts"   # runtime.experts.custom_op (torch.export)


@dataclass(frozen=True)
class MoEFacts:
    """The sizes of one MoE layer at the captured micro-batch."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    ffn: int
    dtype_bytes: int
    bias: int = 0        # bias values of all E experts (GPT-OSS: E (2f + h)), 0 unbiased
    # group-limited routing (DeepSeek-V3: 8, 4): a token's experts lie in topk_groups of
    # `groups` groups of consecutive experts; 1, 1: no limit
    groups: int = 1
    topk_groups: int = 1

    @property
    def group_limit(self) -> tuple[int, int]:
        """(groups, groups per token), what cost_model.hardware.comm.expert_dispatch_time takes."""
        return self.groups, self.topk_groups

    @property
    def expert_flops(self) -> float:
        """Forward FLOPs of the routed experts, all ranks of an EP group together per token
        set: 6 T k h f."""
        return 6.0 * self.tokens * self.top_k * self.hidden * self.ffn

    @property
    def router_flops(self) -> float:
        return 2.0 * self.tokens * self.hidden * self.experts

    @property
    def expert_param_bytes(self) -> float:
        """All E experts' weights and biases (3 E h f + bias values)."""
        return (3.0 * self.experts * self.hidden * self.ffn + self.bias) * self.dtype_bytes

    @property
    def dispatched_bytes(self) -> float:
        """Saved activations of the routed slots: T k (3h + 4f) d (module docstring)."""
        return self.tokens * self.top_k * (3 * self.hidden + 4 * self.ffn) * self.dtype_bytes

    def all_to_all_bytes(self, ep: int, remote: float | None = None) -> float:
        """Bytes one rank sends per micro-batch (forward and backward): 4 T k h d r."""
        r = (ep - 1) / ep if remote is None else remote
        return 4.0 * self.tokens * self.top_k * self.hidden * self.dtype_bytes * r


def facts(node) -> MoEFacts:
    """MoEFacts of a moe_ffn node, or of a routed_experts op (runtime.experts.custom_op: its
    router is in the graph, priced by its own ops), with fake shapes."""
    x = tensor_of(node.args[0])
    tokens, hidden = int(x.numel() // x.shape[-1]), int(x.shape[-1])
    if node.kwargs.get("top_k") is None and hasattr(node.target, "_schema"):
        return _op_facts(node, tokens, hidden, x.element_size())
    router, w_gate = tensor_of(node.args[1]), tensor_of(node.args[2])
    return MoEFacts(tokens, hidden, int(router.shape[0]), int(node.kwargs.get("top_k", 1)),
                    int(w_gate.shape[1]), x.element_size(),
                    groups=int(node.kwargs.get("groups", 1)),
                    topk_groups=int(node.kwargs.get("topk_groups", 1)))


def _op_facts(node, tokens: int, hidden: int, dtype_bytes: int) -> MoEFacts:
    args = op_arguments(node)
    experts, weights, gate_up = int(args["experts"]), tensor_of(args["weights"]), \
        tensor_of(args["gate_up"])
    # gate_up is [E, 2f, h] (Hugging Face's fused layout) or, for GPT-OSS, its transpose
    width = int(gate_up.shape[2 if args["kind"] == "gpt_oss" else 1] // 2)
    # the biases hold this rank's experts (E/ep after the expert-parallel cut): count per expert
    biases = [tensor_of(args[k]) for k in ("gate_up_bias", "down_bias") if args[k] is not None]
    bias = experts * sum(int(b.shape[-1]) for b in biases)
    return MoEFacts(tokens, hidden, experts, int(weights.shape[-1]), width, dtype_bytes, bias,
                    int(args["groups"]), int(args["topk_groups"]))


def balance_bytes(node) -> float:
    """Bytes of the per-sequence statistics a moe_ffn node's balance loss sums over the
    context-parallel group (runtime.experts.dispatch: expert counts and router score sums, [b, 2E] in
    x's dtype; all-reduced once forward and once backward). 0 without a balance loss, and for a
    routed_experts op (its router and any loss on it are in the graph)."""
    if node.kwargs.get("top_k") is None or not node.kwargs.get("aux_coef"):
        return 0.0
    x, router = tensor_of(node.args[0]), tensor_of(node.args[1])
    return float(math.prod(x.shape[:-2]) * 2 * router.shape[0] * x.element_size())


def moe_rule(call: Call) -> OpCost:
    """The node at ep = 1 and balanced routing; the planner adds expert parallelism
    (ExpertPricing)."""
    f = facts(call.node)
    x = tensor_of(call.node.args[0])
    routed_op = call.node.kwargs.get("top_k") is None   # its router is priced apart
    flops = (0.0 if routed_op else f.router_flops) + f.expert_flops
    moved = 2 * nbytes(x) * (1 + f.top_k) + f.expert_param_bytes
    saved = ((f"{call.node.name}:experts", f.dispatched_bytes),
             (f"{call.node.name}:router", 2.0 * f.tokens * f.experts * f.dtype_bytes))
    cost = finish("matmul", flops, BWD_FACTOR * flops, moved, BWD_FACTOR * moved, saved, flops)
    # grouped GEMMs, one per expert: the routed rows over E experts, ffn wide, hidden deep
    return replace(cost, gemm=(float(f.tokens * f.top_k), float(f.ffn), float(f.hidden),
                               f.experts))


def movement_bytes(node) -> tuple[float, float]:
    """(forward, backward) bytes the routed slots move through memory outside the experts'
    GEMMs, per micro-batch of T tokens: per slot, its row gathered into expert order and
    scattered back weighted (read and write h each way: 4h), and the gated activation over
    the gate and up outputs (forward reads 2f and writes f; backward reads 2f and the output's
    gradient f and writes 2f):

        forward   T k (4h + 3f) d        backward   T k (4h + 5f) d

    Memory-bound kernels of their own in every implementation (fused permutes, DeepEP's
    buffers, Transformer Engine's grouped GEMMs between them), so they are priced as their
    own op at memory bandwidth (cost_model.layers.layer_cost), not inside the GEMMs' roofline,
    whose arithmetic term would hide them. With fine-grained experts (Qwen3-30B-A3B: h 2048,
    f 768) they are about a third of the GEMMs' time on an H100."""
    f = facts(node)
    slots = f.tokens * f.top_k * f.dtype_bytes
    return (slots * (4 * f.hidden + 3 * f.ffn), slots * (4 * f.hidden + 5 * f.ffn))


def routed_bytes(node) -> float:
    """The largest tensor the routed experts make, which the op's own output [T, h] does not
    show: the slots' rows in expert order or their gate/up outputs, T k max(h, f) d (what a
    layer's temporary is sized by, cost_model.layers.layer_cost)."""
    f = facts(node)
    return f.tokens * f.top_k * max(f.hidden, f.ffn) * f.dtype_bytes


def expected_max_load(tokens: int, experts: int, k: int, ep: int) -> float:
    """E[max over ep ranks of the slots a rank receives] / mean, for `tokens` tokens routed
    uniformly at random (k distinct experts each) over `experts` experts in ep equal groups."""
    if ep == 1:
        return 1.0
    mean = tokens * k / ep
    share = 1.0 / ep
    var = tokens * k * share * (1 - share) * (experts - k) / max(experts - 1, 1)
    top = mean + math.sqrt(var) * math.sqrt(ep / (ep - 1)) * _max_normal(ep)
    return min(top, tokens * min(k, experts // ep)) / mean


@functools.lru_cache(maxsize=None)
def _max_normal(n: int, steps: int = 4000) -> float:
    """E[max of n independent standard normals], by quadrature of 1 - Phi(x)^n and Phi(x)^n."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    lo, hi = -10.0, 10.0
    dx = (hi - lo) / steps
    total = 0.0
    for i in range(steps):
        x = lo + (i + 0.5) * dx
        p = phi(x) ** n
        total += ((1 - p) if x > 0 else -p) * dx
    return total


@dataclass(frozen=True)
class ExpertPricing:
    """What expert parallelism of size ep changes in one MoE layer's per-micro-batch cost, beside
    the ep = 1 price of `moe_rule`: expert compute on the most loaded rank (x imbalance), the
    all-to-all bytes, and the expert weights each rank holds (1/ep of them)."""

    facts: MoEFacts
    ep: int
    imbalance: float

    @property
    def extra_expert_flops(self) -> float:
        """Forward FLOPs added on the critical rank by imbalance ((imbalance - 1) x balanced)."""
        return self.facts.expert_flops * (self.imbalance - 1.0)

    @property
    def comm_bytes(self) -> float:
        return self.facts.all_to_all_bytes(self.ep)

    @property
    def param_bytes_saved(self) -> float:
        """Expert weight bytes a rank does not hold under ep."""
        return self.facts.expert_param_bytes * (1.0 - 1.0 / self.ep)

    @property
    def extra_activation_bytes(self) -> float:
        """The most loaded rank's extra slots, and under ep > 1 the combine's received rows
        (runtime.experts.dispatch._expert_parallel: T k h d, its own tokens' slots)."""
        f = self.facts
        received = f.tokens * f.top_k * f.hidden * f.dtype_bytes if self.ep > 1 else 0.0
        return f.dispatched_bytes * (self.imbalance - 1.0) + received


def pricing(f: MoEFacts, ep: int, micro_batch_tokens: int | None = None,
            imbalance: float | None = None) -> ExpertPricing:
    """ExpertPricing of a layer; imbalance defaults to the uniform-routing expected maximum over
    the tokens one EP group routes per micro-batch (ep x the rank's own)."""
    tokens = (micro_batch_tokens or f.tokens) * ep
    factor = imbalance if imbalance is not None else expected_max_load(tokens, f.experts,
                                                                       f.top_k, ep)
    if not factor >= 1.0:
        raise ValueError(f"MoE imbalance must be >= 1 (the most loaded rank's share over the "
                         f"mean), got {factor!r}")
    return ExpertPricing(f, ep, factor)
