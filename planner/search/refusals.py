"""Why nothing plans: the filter of planner.search.meshes that removed the last configurations, and the
nearest legal value of the setting it refused (or, when no setting was fixed, the nearest GPU
counts that do plan) — one line for PlanningError."""
from __future__ import annotations

import math
from dataclasses import replace

from planner.search.costs import ModelCosts
from planner.search.meshes import (MESH_KEYS, Refusal, Request, configurations, divisors,
                            factorisations, fixed_mesh, mesh_refusal, schedule_options,
                            schedule_refusal, search)


def refusal(costs: ModelCosts, req: Request) -> Refusal | None:
    """The filter that removed the last configurations, or None when some configuration passes
    every filter (then only memory, or the ILP, can leave nothing)."""
    fix = req.fix
    fixed = [(k, fix[k]) for k in fix if k in MESH_KEYS]
    product = math.prod(v for _, v in fixed)
    if req.gpus % product or (len(fixed) == 4 and product != req.gpus):
        what = " × ".join(f"{k}={v}" for k, v in fixed)
        what += f" = {product}" if len(fixed) > 1 else ""
        verb = "is not" if len(fixed) == 4 else "does not divide"
        return Refusal(0, f"{what} {verb} the {req.gpus} GPUs",
                       tuple(k for k, _ in reversed(fixed)))
    shard = fix.get("dp_shard")
    if shard and all(m[0] % shard for m in factorisations(req.gpus) if fixed_mesh(req, *m)):
        within = f" with {', '.join(f'{k}={v}' for k, v in fixed)}" if fixed else ""
        return Refusal(6, f"dp_shard={shard} must divide dp (a shard group is dp_shard of the "
                          f"dp ranks), and no dp × tp × pp × cp mesh of the {req.gpus} "
                          f"GPUs{within} has a dp it divides", ("dp_shard",))
    deepest = None
    for mesh in factorisations(req.gpus):
        if not fixed_mesh(req, *mesh):
            continue
        found = mesh_refusal(costs, req, *mesh)
        if found is None:
            found = _batching_refusal(costs, req, mesh[0], mesh[3])
            if found is None:
                return None
        if deepest is None or found.depth > deepest.depth:
            deepest = found
    return deepest


def _batching_refusal(costs: ModelCosts, req: Request, dp: int, pp: int) -> Refusal | None:
    """Why no micro-batching and schedule of a mesh passes (None when one does)."""
    fix, per_replica, first = req.fix, req.global_batch // dp, None
    if "mb" in fix and per_replica % fix["mb"]:
        return Refusal(7, f"mb={fix['mb']} does not divide the per-replica batch {per_replica} "
                          f"(global batch {req.global_batch} / dp={dp})", ("mb",))
    options = schedule_options(req)
    if not options:
        return Refusal(8, f"v={fix['v']} needs schedule interleaved-1f1b, which the search is "
                          f"not given", ("v",))
    for b in divisors(per_replica):
        if "mb" in fix and fix["mb"] != b:
            continue
        for name, v in options:
            if pp == 1 and name != options[0][0]:
                continue
            found = schedule_refusal(pp, per_replica // b, costs.num_blocks, name, v)
            if found is None:
                return None
            first = first or found
    return first


def legal_values(costs: ModelCosts, req: Request, key: str) -> list:
    """The values of a fixed setting that pass every filter when that setting is left free."""
    loose = {k: v for k, v in req.fix.items() if k != key}
    if key == "schedule":
        loose.pop("v", None)
    attribute = {"mb": "micro_batch"}.get(key, key)
    free = replace(req, fix=loose)
    if key == "dp_shard":  # any divisor of a dp that plans (unfixed, the search tries few)
        return sorted({d for c in configurations(costs, free) for d in divisors(c.dp)})
    return sorted({getattr(c, attribute) for c in configurations(costs, free)})


def nearest(values: list, wanted) -> str:
    """'2 or 4': the legal values just below and above the wanted one (all of them for names)."""
    if not values or not all(isinstance(v, int) for v in values):
        return ", ".join(map(str, values))
    below = [v for v in values if v < wanted][-1:]
    above = [v for v in values if v > wanted][:1]
    return " or ".join(str(v) for v in below + above)


def plannable_gpus(costs: ModelCosts, req: Request, tries: int = 3) -> list[int]:
    """The GPU counts nearest req.gpus, one below and one above, for which the request plans."""
    found = []
    for step in (-1, 1):
        gpus, searched = req.gpus + step, 0
        while 1 <= gpus <= 2 * req.gpus + 8 and searched < tries:
            other = replace(req, gpus=gpus, top_k=1)
            if next(configurations(costs, other), None) is not None:
                searched += 1
                if search(costs, other):
                    found.append(gpus)
                    break
            gpus += step
    return found


def why_nothing_plans(costs: ModelCosts, req: Request) -> str | None:
    """The one-line reason no configuration is left (the filter that removed the last ones and
    the nearest legal value), or None when configurations pass every filter."""
    found = refusal(costs, req)
    if found is None:
        return None
    for key in found.keys:
        if key in req.fix and key != "strategy":
            values = legal_values(costs, req, key)
            if values:
                numbers = all(isinstance(v, int) for v in values)
                return (f"{found.reason}; {'nearest ' if numbers else ''}legal {key}: "
                        f"{nearest(values, req.fix[key])}")
    if any(k in req.fix for k in found.keys):
        return found.reason
    fixed = ", ".join(f"{k}={v}" for k, v in req.fix.items())
    counts = plannable_gpus(costs, req)
    return (f"{req.gpus} GPUs: no factorisation into dp × tp × pp × cp fits the model and global "
            f"batch {req.global_batch}{f' with {fixed}' if fixed else ''} (the last filter, e.g.: "
            f"{found.reason}); "
            + (f"nearest GPU counts that plan: {' or '.join(map(str, counts))}" if counts
               else "no GPU count near it plans"))
