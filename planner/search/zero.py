"""The sharded-data-parallel axis of the search: which ZeRO levels and dp_shard sizes a mesh
offers, the cost_model.layers.sharding.Sharding of a candidate, and its per-step collective terms.

Levels 1-3 shard over the dp x cp ranks that hold the same weights (runtime.data_parallel.sharded_dp), or,
with dp_shard < dp (hybrid sharding), over dp_shard x cp of them, replicated across the rest. A
mesh whose replicas are one rank (dp = cp = 1) has nothing to shard: level 0 only.
"""
from __future__ import annotations

from functools import lru_cache

from cost_model.hardware.comm import collective_time
from cost_model.layers.sharding import LEVELS, Sharding, SyncParts, held_bytes, step_traffic, sync_parts


def check_zero_fix(fix: dict) -> None:
    """Refuse fixed zero / dp_shard values no plan can have, naming the legal ones."""
    zero = fix.get("zero")
    if zero is not None and (isinstance(zero, bool) or zero not in LEVELS):
        raise ValueError(f"zero must be one of {', '.join(map(str, LEVELS))}, got {zero!r}")
    shard = fix.get("dp_shard")
    if shard is None:
        return
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ValueError(f"dp_shard must be a positive integer (1, 2, 3, ...), got {shard!r}")
    if zero == 0:
        raise ValueError(f"dp_shard={shard} shards over data parallel, which zero=0 does not; "
                         f"fix zero=1, 2 or 3 with it")
    if "dp" in fix and fix["dp"] % shard:
        raise ValueError(f"dp_shard={shard} does not divide dp={fix['dp']}; legal dp_shard: "
                         f"{', '.join(str(d) for d in range(1, fix['dp'] + 1) if fix['dp'] % d == 0)}")


def zero_options(fix: dict, dp: int, cp: int, tp: int = 1,
                 node: int = 0) -> list[tuple[int, int]]:
    """(level, dp_shard) pairs to try on a mesh; dp_shard = dp unless hybrid. Unless fixed,
    hybrid sharding is tried as HSDP lays it out: at level 3, shard groups of one node
    (dp_shard x cp x tp = `node` GPUs), replicated across nodes."""
    if "dp_shard" in fix and dp % fix["dp_shard"]:
        return []
    if dp * cp == 1:  # one rank per replica group: every level is level 0
        return [(fix.get("zero", 0), dp)]
    levels = [fix["zero"]] if "zero" in fix else (
        list(LEVELS[1:]) if "dp_shard" in fix else list(LEVELS))
    out = []
    for level in levels:
        if level == 0:
            out.append((0, dp))
            continue
        shards = [fix["dp_shard"]] if "dp_shard" in fix else [dp]
        within = node // (cp * tp) if node and node % (cp * tp) == 0 else 0
        if ("dp_shard" not in fix and level == 3 and 1 < within < dp and dp % within == 0
                and within * cp > 1):
            shards.append(within)
        out += [(level, d) for d in shards]
    return out


def sharding_of(c) -> Sharding:
    """The Sharding of a search candidate (planner.search.meshes.Candidate)."""
    shard = c.dp_shard or c.dp
    backward = 2 if c.schedule == "zb-h1" else 1
    return Sharding(c.zero, shard * c.cp, c.dp // shard, c.microbatches, backward)


def comm_terms(cluster, c, sharding: Sharding, weight_per_grad: float, units: int) -> SyncParts:
    return _comm_terms(cluster, c.tp, sharding, weight_per_grad, units)


@lru_cache(maxsize=65536)
def _comm_terms(cluster, tp, sharding, weight_per_grad, units) -> SyncParts:
    """The candidate's data-parallel collectives for a rank holding `units` layers
    (cost_model.layers.sharding.sync_parts). The shard group is n ranks tp apart; the replicate
    group r ranks, n x tp apart."""
    def terms(kind, n, stride):
        alpha = collective_time(cluster, kind, 0.0, n, stride=stride)
        slope = (collective_time(cluster, kind, 2.0**30, n, stride=stride) - alpha) / 2**30
        return alpha, slope
    s = sharding
    rs = terms("reduce_scatter", s.n, tp)
    ag = terms("all_gather", s.n, tp)
    ar = terms("all_reduce", s.r, s.n * tp)
    return sync_parts(s, weight_per_grad, *rs, *ag, *ar, units)


def gpt_layer_numels(model) -> dict[str, int]:
    """Parameter counts per plan layer of fxpar's GPT (blocks.i, embed = wte + wpe, head)."""
    numels: dict[str, int] = {}
    for name, p in model.named_parameters():
        layer = (".".join(name.split(".")[:2]) if name.startswith("blocks.")
                 else "embed" if name.startswith(("wte", "wpe")) else "head")
        numels[layer] = numels.get(layer, 0) + p.numel()
    return numels


def priced_stage(numels: dict[str, int], chosen, stage: int, optimizer_states: int = 1):
    """cost_model.layers.sharding's bytes held and sent per step by one pipeline stage of `chosen`, for
    fp32 layers of `numels` parameters each (what runtime.data_parallel.sharded_dp holds and moves)."""
    shard = chosen.dp_shard or chosen.dp
    backward = 2 if chosen.schedule == "zb-h1" else 1
    sharding = Sharding(chosen.zero, shard * chosen.cp, chosen.dp // shard,
                        chosen.num_microbatches, backward)
    # Stage 0 of ZB-H1 has no boundary input: its I step is free and reads no weights.
    gathers = 1 if chosen.schedule == "zb-h1" and stage == 0 else backward
    layers = chosen.stages[stage].layers
    held = held_bytes([(numels[l], 4, 4) for l in layers], sharding, optimizer_states)
    return held, step_traffic([(numels[l], 4, 4, gathers) for l in layers], sharding)
