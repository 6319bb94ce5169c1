"""Mixture-of-experts feed-forward: top-k routing, dropless dispatch to the experts' ranks and
combination back, and the process groups of expert parallelism (EP).

`moe_ffn` is one call node in a captured graph (the model wraps it with `torch.fx.wrap`), so the
tensor-parallel rewrite sees a replicated op (the router stays whole, as it must: a softmax or a
top-k over sharded expert scores would be wrong) and the expert-parallel rewrite
(passes.rewrite.expert_parallel) only cuts its stacked expert weights and sets `ep`.

Routing (per token, E experts, top k):
  softmax  p = softmax(x Wr^T); the top-k of p, renormalised to sum 1 when `norm_topk`
           (Mixtral, Qwen3-MoE)
  sigmoid  p = sigmoid(x Wr^T); the top-k of p, renormalised to sum 1 (DeepSeek-V3)
  the weights are multiplied by `scale` (DeepSeek-V3's routed scaling factor).
Group-limited ("node-limited") choice, DeepSeek-V3's (`groups` n > 1, `topk_groups` g < n): the E
experts form n groups of E/n consecutive experts; a group's score is the sum of its two highest
selection scores, each token keeps the g groups of highest score and takes its top k among their
g E/n experts only. The selection scores are p, plus DeepSeek's e_score_correction_bias where one
is given (`route`'s `bias`: it steers the choice, never the weights, which are p of the chosen
experts). With consecutive expert ranges per rank, and each group within one node, a token then
crosses the network to at most g nodes (what DeepEP's internode dispatch exploits).
`route` is transformers' DeepseekV3TopkRouter (tests/unit/test_moe.py checks the two agree).
Experts are SwiGLU: down(silu(gate x) * up x), weights stacked [E, f, h], [E, f, h], [E, h, f]
(`ExpertWeights`, which also holds the fused layouts of Hugging Face's experts modules that
runtime.experts.custom_op computes: [E, 2f, h] gate_up, and GPT-OSS's biased, interleaved, clamped
form).

Dispatch is dropless (no capacity factor): every (token, slot) pair reaches its expert, so the
result equals one process up to summation order. With ep ranks, each holds E/ep consecutive
experts; pairs are sorted by expert, the per-expert counts are exchanged (an all_to_all_single of
E integers), the tokens are sent with an all_to_all_single of uneven splits, regrouped by local
expert, computed, and sent back the same way. Both exchanges are differentiable (their backward
is the reverse exchange) and counted in collectives.TRAFFIC as kind "all_to_all" with the bytes
this rank sends to other ranks (what it keeps is not on the wire).

Auxiliary load-balancing loss (Switch / Mixtral form, computed per sequence as DeepSeek-V3 does,
so that it is a mean over sequences like the language-model loss, and splitting the batch over
data-parallel ranks and micro-batches leaves it exact):
  aux = coef * mean_b  sum_e  (E / (k s)) count_{b,e} * mean_s p_{b,s,e}
Under context parallelism (`seq_parts` > 1, set by passes.rewrite.expert_parallel.split_balance) a rank
holds s / seq_parts tokens of each sequence: its counts and sums of p ([b, E] each, one [b, 2E]
tensor) are summed over the group `seq_group` with collectives.group_sum (counted as
"all_reduce" under the layer's tag, forward and backward) and divided by the whole s, so every
rank forms the loss of the whole sequences; the trainer's average over the group and the summed
gradient of group_sum make loss and gradients those of one process.
On fake or meta tensors (shape propagation, pricing) only shapes are computed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.comm import collectives
from runtime.comm.mesh import per_world
from runtime.experts import routing_log

_EP_GROUP: list = [None]   # this rank's expert-parallel group (None: one rank)


def bind_ep_group(group: dist.ProcessGroup | None) -> None:
    _EP_GROUP[0] = group


def _fake(x: torch.Tensor) -> bool:
    """Shapes only, while a model is captured (a dry run's fake tensors route: `_routing`)."""
    return collectives._fake(x)


def moe_ffn(x: torch.Tensor, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor, *, top_k: int, score: str = "softmax", norm_topk: bool = True,
            scale: float = 1.0, aux_coef: float = 0.0, ep: int = 1, tag: str = "moe",
            seq_parts: int = 1, seq_group: str = "cp", groups: int = 1, topk_groups: int = 1):
    """x [b, s, h] -> (y [b, s, h], aux loss scalar or None). `w_*` hold this rank's E/ep
    experts; router [E, h] is whole. seq_parts > 1: x holds this rank's share of sequences split
    over the `seq_parts` ranks of group `seq_group` (the balance loss is then of the whole
    sequences). groups, topk_groups: group-limited choice (module doc; 1, 1: none)."""
    experts = router.shape[0]
    check_groups(experts, top_k, groups, topk_groups)
    if _fake(x):
        aux = x.new_empty(()) if aux_coef else None
        return x.new_empty(x.shape), aux
    probs, top, index = route(x @ router.t(), top_k, score, norm_topk, scale, groups,
                              topk_groups)
    aux = (_balance_loss(probs, index, experts, top_k, seq_parts, seq_group, tag) * aux_coef
           if aux_coef else None)
    flat = x.flatten(0, -2)
    y = _routed(flat, top.flatten(0, -2), index.flatten(0, -2),
                ExpertWeights(w_gate, w_up, w_down), experts, ep, tag)
    return y.view_as(x), aux


def route(logits: torch.Tensor, top_k: int, score: str = "softmax", norm_topk: bool = True,
          scale: float = 1.0, groups: int = 1, topk_groups: int = 1,
          bias: torch.Tensor | None = None):
    """Router logits [..., E] -> (p [..., E], weights [..., k], index [..., k]): each token's
    top_k experts (among its topk_groups best groups of `groups` when groups limit the choice)
    by p + bias, weighted by their p, renormalised (norm_topk, or always for sigmoid scores, as
    DeepSeek-V3 does) and times `scale`."""
    probs = _scores(logits, score)
    choice = probs if bias is None else probs + bias
    if topk_groups < groups:
        choice = _within_best_groups(choice, groups, topk_groups)
    index = choice.topk(top_k, dim=-1).indices
    top = probs.gather(-1, index)
    if norm_topk or score == "sigmoid":
        top = top / top.sum(-1, keepdim=True)
    return probs, top * scale, index


def _within_best_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """The selection scores [..., E] with every expert outside the token's `keep` best groups
    set to -inf; a group's score is the sum of its two best experts' scores (DeepSeek-V3's
    rule, as transformers' DeepseekV3TopkRouter computes it: topk(2) per group, summed)."""
    grouped = choice.unflatten(-1, (groups, -1))                 # [..., n, E/n]
    group_score = grouped.topk(2, dim=-1).values.sum(-1)         # [..., n]
    best = group_score.topk(keep, dim=-1).indices
    kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, best, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)


def check_groups(experts: int, top_k: int, groups: int, topk_groups: int) -> None:
    """A one-line ValueError unless `groups` groups of `experts`, `topk_groups` kept per token,
    can route top_k experts: groups divides the experts into groups of two or more (a group's
    score is its best two), 1 <= topk_groups <= groups, and the kept groups hold top_k experts."""
    for name, value in (("groups", groups), ("topk_groups", topk_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expert {name} must be a positive integer, got {value!r}")
    if groups == 1 and topk_groups == 1:
        return
    if experts % groups or experts // groups < 2:
        raise ValueError(f"{groups} expert groups must split the {experts} experts into equal "
                         f"groups of at least 2")
    if topk_groups > groups:
        raise ValueError(f"topk_groups={topk_groups} exceeds the {groups} expert groups")
    if top_k > topk_groups * (experts // groups):
        raise ValueError(f"top_k={top_k} exceeds the {topk_groups * (experts // groups)} experts "
                         f"of a token's {topk_groups} groups")


def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    if score == "softmax":
        return F.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
    if score == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"router score must be 'softmax' or 'sigmoid', got {score!r}")


def _balance_loss(probs: torch.Tensor, index: torch.Tensor, experts: int, k: int,
                  seq_parts: int = 1, seq_group: str = "cp", tag: str = "moe"):
    """Per-sequence balance loss, averaged over the sequences of the batch (dim 0); with
    seq_parts > 1, of the whole sequences whose shares the ranks of `seq_group` hold."""
    if isinstance(seq_parts, bool) or not isinstance(seq_parts, int) or seq_parts < 1:
        raise ValueError(f"moe_ffn seq_parts (the ranks a sequence is split over) must be a "
                         f"positive integer, got {seq_parts!r}")
    seq = probs.shape[-2]
    counts = torch.zeros(*index.shape[:-2], experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(-1, index.flatten(-2), torch.ones_like(index.flatten(-2), dtype=probs.dtype))
    if seq_parts == 1:
        mean = probs.mean(-2)
    else:
        stats = collectives.group_sum(torch.cat([counts, probs.sum(-2)], -1), seq_group, tag,
                                      seq_parts)
        seq *= seq_parts
        counts, mean = stats[..., :experts], stats[..., experts:] / seq
    load = counts * (experts / (k * seq))
    return (load * mean).sum(-1).mean()


KINDS = ("swiglu", "gpt_oss")   # the expert functions ExpertWeights computes


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """This rank's stacked expert weights (its E/ep experts on dim 0 of each; `unbound()`: a
    tuple of the experts' own) and the function every expert computes with them, on the rows
    x [n, h] routed to it:

    "swiglu"   down(silu(gate x) * up x): gate, up [E, f, h], down [E, h, f]; `up` None: `gate`
               is Hugging Face's fused gate_up [E, 2f, h], gate rows first, then up rows;
               optional biases gate_bias [E, 2f] (fused only) and down_bias [E, h].
    "gpt_oss"  transformers' GptOssExperts: gate_up = x gate + gate_bias, gate [E, h, 2f] (the
               transpose of the fused layout) with gate and up interleaved (columns 0::2 and
               1::2), bias [E, 2f]; g = min(gate, limit), u = clamp(up, -limit, limit);
               (u + 1) * g * sigmoid(alpha g) down + down_bias, down [E, f, h], bias [E, h].
    """

    gate: torch.Tensor
    up: torch.Tensor | None
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    kind: str = "swiglu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"expert kind must be one of {KINDS}, got {self.kind!r}")
        if self.up is not None and (self.kind != "swiglu" or self.gate_bias is not None):
            raise ValueError("separate gate and up expert weights are SwiGLU without gate bias")

    @property
    def local(self) -> int:
        """The experts this rank holds."""
        return len(self.gate)

    def unbound(self) -> ExpertWeights:
        """The same experts, each stacked weight unbound once into per-expert tensors. Indexing
        a stacked weight per expert (`gate[e]`) makes the backward write a whole [E, ...]
        gradient for every expert (select's backward) and sum the E of them: E weight-sized
        temporaries; unbind's backward stacks the experts' gradients into one."""
        def split(t):
            return None if t is None else t.unbind(0)
        return dataclasses.replace(self, gate=split(self.gate), up=split(self.up),
                                   down=split(self.down), gate_bias=split(self.gate_bias),
                                   down_bias=split(self.down_bias))

    def __call__(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert e (local index) on its rows [n, h] -> [n, h]."""
        if self.kind == "gpt_oss":
            return self._gpt_oss(e, rows)
        if self.up is None:
            gate, up = F.linear(rows, self.gate[e], _row(self.gate_bias, e)).chunk(2, dim=-1)
        else:
            gate, up = F.linear(rows, self.gate[e]), F.linear(rows, self.up[e])
        return F.linear(F.silu(gate) * up, self.down[e], _row(self.down_bias, e))

    def _gpt_oss(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        # The same operations in the same order as transformers' GptOssExperts (its
        # `_apply_gate`), so that the two agree to rounding.
        gate_up = rows @ self.gate[e] + self.gate_bias[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        mid = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return mid @ self.down[e] + self.down_bias[e]


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def _routed(flat, weights, index, experts_w: ExpertWeights, experts: int, ep: int, tag: str):
    """The weighted sum of each token's top-k experts' outputs, [tokens, h]."""
    k = index.shape[-1]
    slots = index.flatten()
    order = torch.argsort(slots, stable=True)
    token = order // k
    sent = flat[token]
    counts, got = _routing(slots, experts, ep)
    if ep == 1:
        out = _experts(sent, counts, experts_w)
    else:
        out = _expert_parallel(sent, counts, got, experts_w, tag)
    out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(flat).index_add(0, token, out)


def _routing(slots: torch.Tensor, experts: int, ep: int):
    """(rows this rank sends to each expert, rows each local expert gets from each rank of the
    EP group: runtime.experts.routing_log's form). A dry run has no values to route by: it
    routes as recorded, or evenly."""
    group = _ep_group(ep) if ep > 1 else None
    if collectives.dry_running():
        me = dist.get_rank(group) if group is not None else 0
        return routing_log.dry_routing(slots.shape[0], experts, ep, me)
    counts = torch.bincount(slots, minlength=experts)
    if group is None:
        got = counts.view(1, -1)
    else:
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts.contiguous(), group=group)
    sent, got = counts.tolist(), got.view(ep, -1).tolist()
    routing_log.record(sent, got)
    return sent, got


def _ep_group(ep: int) -> dist.ProcessGroup:
    group = _EP_GROUP[0]
    if group is None or dist.get_world_size(group) != ep:
        have = dist.get_world_size(group) if group is not None else 1
        raise RuntimeError(f"moe_ffn with ep={ep} but the bound expert-parallel group has "
                           f"{have} ranks (runtime.experts.dispatch.bind_ep_group)")
    return group


def _experts(rows: torch.Tensor, counts: list[int], experts_w: ExpertWeights) -> torch.Tensor:
    """Each local expert on its contiguous run of rows."""
    experts_w = experts_w.unbound()
    outs = [experts_w(e, part) for e, part in enumerate(rows.split(counts)) if part.shape[0]]
    return torch.cat(outs) if outs else rows.new_zeros(rows.shape)


def _expert_parallel(sent, counts: list[int], got: list[list[int]], experts_w: ExpertWeights,
                     tag: str) -> torch.Tensor:
    ep, local = len(got), experts_w.local
    send_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
    recv_splits = [sum(row) for row in got]
    received = AllToAll.apply(sent, recv_splits, send_splits, tag)
    regroup = _regroup(got, sent.device)
    out = _experts(received[regroup], [sum(col) for col in zip(*got)], experts_w)
    back = torch.empty_like(out).index_copy(0, regroup, out) if out.shape[0] else out
    return AllToAll.apply(back, send_splits, recv_splits, tag)


def _regroup(got: list[list[int]], device) -> torch.Tensor:
    """Rows arrive ordered (source, expert): the order that groups them (expert, source), one
    run per expert. A dry run's rows hold no values, so any index of the right length does."""
    rows = sum(map(sum, got))
    if collectives.dry_running():
        return torch.empty(rows, dtype=torch.long, device=device)
    local = len(got[0])
    expert_of_row = torch.arange(local, device=device).repeat(len(got)).repeat_interleave(
        torch.tensor([n for row in got for n in row], device=device), output_size=rows)
    return torch.argsort(expert_of_row, stable=True)


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], tag: str):
        ctx.splits, ctx.tag = (out_splits, in_splits), tag
        return _exchange(x, out_splits, in_splits, tag)

    @staticmethod
    def backward(ctx, grad):
        # A split backward (ZB-H1) reaches this node twice, towards the stage's inputs (I) and
        # again towards its weights (W), with the same gradient both times (every consumer of
        # the output lies on both paths): exchange once, as priced, and hand W the same result.
        if getattr(ctx, "sent", None) is None:
            out_splits, in_splits = ctx.splits
            ctx.sent = _exchange(grad.contiguous(), in_splits, out_splits, ctx.tag)
        return ctx.sent, None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], tag: str):
    group = _EP_GROUP[0]
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    row = x[0].numel() * x.element_size() if x.dim() and x.shape[0] else 0
    me = dist.get_rank(group)
    table = collectives.RECOMPUTE_TRAFFIC if collectives._recomputing[0] else collectives.TRAFFIC
    table[("all_to_all", tag)] += float(row * (sum(in_splits) - in_splits[me]))
    return out


# -- the process groups of expert parallelism ----------------------------------------------------

@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in expert parallelism. The ranks holding the same weights (dp x cp, the
    mesh's replicas) are cut into consecutive EP groups of `ep`; the rank at index i of its EP
    group holds experts [i E/ep, (i+1) E/ep). `replicas` joins the ranks holding the same experts
    (one per EP group): expert gradients are summed over it, the rest of the model over all
    replicas."""

    ep: int
    index: int
    group: dist.ProcessGroup | None
    replicas: dist.ProcessGroup | None
    first_replica: bool        # in the first EP group: counts expert weights in the grad norm
    first_rank: int            # global rank of this EP group's index 0
    replica_root: int          # global rank holding these experts in the first EP group


_BUILT: dict = {}


def expert_groups(mesh, ep: int) -> ExpertGroups:
    """Create (once per mesh and ep, a collective over all ranks) this rank's EP groups."""
    replicas = mesh.dp * mesh.cp
    if ep < 1 or replicas % ep:
        raise ValueError(f"expert parallel size ep={ep} must divide the data-parallel x "
                         f"context-parallel ranks ({mesh.dp} x {mesh.cp} = {replicas})")
    return per_world(_BUILT, (mesh, ep), lambda: _create(mesh, ep))


def _create(mesh, ep: int) -> ExpertGroups:
    rank = dist.get_rank()
    mine: dict = {}
    for ranks in mesh.groups(("dp", "cp")):   # ordered dp-major, cp-minor
        for start in range(0, len(ranks), ep):
            _join(mine, "group", ranks[start:start + ep], rank)
        for i in range(ep):
            _join(mine, "replicas", ranks[i::ep], rank)
        if rank in ranks:
            position = ranks.index(rank)
            mine["index"] = position % ep
            mine["first_rank"] = ranks[position - position % ep]
            mine["replica_root"] = ranks[position % ep]
            mine["first"] = position < ep
    return ExpertGroups(ep, mine["index"], mine.get("group"), mine.get("replicas"),
                        mine["first"], mine["first_rank"], mine["replica_root"])


def _join(mine: dict, name: str, ranks: list[int], rank: int) -> None:
    group = dist.new_group(ranks) if len(ranks) > 1 else None
    if rank in ranks:
        mine[name] = group


def is_expert(param: torch.Tensor) -> bool:
    """Whether a parameter holds some experts' weights, cut by passes.rewrite.expert_parallel."""
    return getattr(param, "fxpar_expert", None) is not None


def broadcast_experts(params: list[torch.Tensor], groups, experts: ExpertGroups | None) -> None:
    """Make the copies of each expert weight equal at set-up (runtime.data_parallel.replicas does the rest of
    the model): from tensor-parallel index 0 over tp (experts are whole on every tp rank), then
    from the first EP group over the ranks holding the same experts. `params` in the same order
    on every rank of a group."""
    if not params:
        return
    if experts is None:
        raise ValueError("expert weights cut for expert parallelism need the ExpertGroups of the "
                         "mesh (runtime.experts.dispatch.expert_groups)")
    mesh, c = groups.mesh, groups
    with torch.no_grad():
        if groups.tp is not None:
            src = mesh.rank(c.pp_index, c.dp_index, 0, c.cp_index)
            for p in params:
                dist.broadcast(p.data, src=src, group=groups.tp)
        if experts.replicas is not None:
            for p in params:
                dist.broadcast(p.data, src=experts.replica_root, group=experts.replicas)
