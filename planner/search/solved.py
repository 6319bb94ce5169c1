"""The Plan of a solved search candidate: its stages (layers, strategies, memory), and what it
predicts — the ILP's terms, or on a cluster that prices the runtime's own time the whole step
simulated (planner.search.step_prediction)."""
from __future__ import annotations

from dataclasses import replace

from cost_model.layers.strategy import Strategy
from planner.search import ilp
from planner.search import zero as zero_axis
from planner.search.plan import Plan, Predicted, StagePlan
from planner.search.problem import device_bytes, records
from planner.search.step_prediction import simulated


def make_plan(costs, req, cand, problem, blocks, solution) -> Plan:
    """The plan of a solved candidate; `solver` says how it was solved: "optimal" or
    "feasible" (stopped by the time limit) and the gap to the proven bound; the seconds go to
    `timing`, which equality and the JSON without timing leave out. Each rank's predicted
    peak is `rank_memory`; a stage's "memory/device" holds its rank's "other" part (the
    largest temporary, ZeRO's whole-layer buffers) on the rank's first stage."""
    parts = ilp.breakdown(problem, solution.counts)
    stages, index = [], 0
    end = ("vocab-tp" if costs.vocab_parallel(cand.tp, cand.micro_batch, req.cluster, cand.cp)
           else "none")
    ends = costs.end_costs(cand.micro_batch, req.cluster, padded=True, cp=cand.cp, tp=cand.tp)
    memory = tuple(rank_memory(costs, problem, solution.counts, zero_axis.sharding_of(cand), r,
                               chosen_temp(problem, solution.counts, blocks, ends, r))
                   for r in range(problem.ranks))
    for s, counts in enumerate(solution.counts):
        names = ["embed"] if s == 0 and costs.has("embed") else []
        strategies = [end] * len(names)
        for k, count in enumerate(counts):
            names += [costs.block_name(index + i) for i in range(count)]
            strategies += [problem.options[k].name] * count
            index += count
        if s == problem.stages - 1 and costs.has("head"):
            names.append("head")
            strategies.append(end)
        layer_costs = [c for k, c in enumerate(blocks) for _ in range(counts[k])]
        layer_costs += [c for c in (ends[0] if s == 0 else None,
                                    ends[1] if s == problem.stages - 1 else None) if c]
        stages.append(_stage_plan(costs, problem, s, solution.counts, tuple(names),
                                  tuple(strategies),
                                  zero_axis.sharding_of(cand), parts.stage_s[s],
                                  memory[s][-1] if s < problem.ranks else 0.0, layer_costs))
    plan = Plan(req.model_name, req.gpus, req.cluster.name, cand.dp, cand.tp, cand.pp,
                cand.micro_batch, cand.microbatches, req.global_batch, req.seq, cand.schedule,
                req.memory_limit, tuple(stages),
                _predict(costs, req, cand, problem, blocks, solution.counts, parts, memory),
                tp_unused(req, cand.tp) + costs.notes(cand.tp) + costs.selective_notes(
                    cand.tp, [s for st in stages for s in st.strategies]),
                solver_text(solution.status, solution.gap, solution.stop), cand.v, cand.cp,
                {"solve_s": round(solution.seconds, 4)}, zero=cand.zero,
                dp_shard=cand.dp_shard or None, params=costs.param_count(),
                sizes_from=req.sizes_from, sequences=req.sequences, runtime=req.cluster.runtime,
                split_backward="record" if records(req, cand) else "", autocast=costs.autocast)
    if req.cluster.runtime_priced:  # the whole step simulated on shared cores
        plan = replace(plan, predicted=simulated(plan, req.cluster, req.global_batch *
                                                 costs.flops_per_sample()))
    return plan


def peak_form(problem, counts, r: int) -> tuple:
    """Rank r's peak form (ilp.rank_forms): the lazy gradients' coefficient, per local stage
    the activation sets and the recorded gradients' sets it holds at its peak, ZeRO's buffers
    beside them."""
    parts = ilp.rank_parts(problem, counts, r)
    peaks = parts.peaks()
    return parts.forms()[peaks.index(max(peaks))]


def _stage_plan(costs, problem, s, counts_all, names, strategies, dp, time_s,
                other: float = 0.0, layer_costs=()) -> StagePlan:
    counts = counts_all[s]
    r = problem.rank_of(s)
    g, factors, _, _, _ = peak_form(problem, counts_all, r)
    phi = factors[s // problem.ranks]
    ends = ilp._ends(problem, s)
    static = sum(c * o.static_bytes for c, o in zip(counts, problem.options))
    static += sum(e.static_bytes for e in ends)
    weights, opt = costs.split_static(static, dp)
    # as rank_memory: the lazy gradients the rank's peak form leaves out (g = -1) are not there
    weights += g * (sum(c * o.lazy_grad_bytes for c, o in zip(counts, problem.options))
                    + sum(e.lazy_grad_bytes for e in ends))
    act = phi * (sum(c * o.act_bytes for c, o in zip(counts, problem.options))
                 + sum(e.act_bytes for e in ends))
    step = sum(c * o.step_s for c, o in zip(counts, problem.options))
    step += sum(e.step_s for e in ends)
    return StagePlan(names, strategies, time_s, weights + other, opt, act,
                     sum(c.fwd_s for c in layer_costs), sum(c.bwd_s for c in layer_costs), step,
                     other)


def _predict(costs, req, cand, problem, blocks, counts, parts: ilp.Breakdown,
             memory: tuple) -> Predicted:
    """Split the ILP's iteration time (from ilp.breakdown) into compute, exposed communication
    and bubble on the busiest rank."""
    m, busiest = cand.microbatches, parts.busiest
    comm = [b.comm_s for b in blocks]  # per option: names repeat across kinds
    comm_per_mb = sum(c * comm[k] for s in problem.stages_of(busiest)
                      for k, c in enumerate(counts[s]))
    comm_per_mb += sum(ilp._p2p(problem, s) for s in problem.stages_of(busiest))
    busy = m * parts.rank_s[busiest]
    iteration = parts.iteration_s
    bubble = iteration - busy - parts.sync_s
    bubble = bubble if bubble > 1e-9 * iteration else 0.0  # rounding leaves ±1e-16
    flops = req.global_batch * costs.flops_per_sample()
    syncs = tuple(ilp._sync_time(problem, ilp._rank_load(problem, counts, r)[1],
                                 parts.rank_s[r]) + problem.tie_time(r)
                  for r in range(problem.ranks))
    tensors = max(sum(r) for r in memory)
    peak = device_bytes(costs, req, cand, tensors)
    return Predicted(iteration, busy - m * comm_per_mb, m * comm_per_mb + parts.sync_s, bubble,
                     bubble / busy, peak,
                     req.global_batch * req.seq / iteration,
                     flops / iteration / req.gpus / 1e12, problem.p2p_s / 2, syncs,
                     rank_memory=memory, device_bytes=peak - tensors)


def chosen_temp(problem, counts, blocks, ends, r: int) -> float:
    """The largest temporary (LayerCost.temp_bytes) of the layers rank r holds. The search's
    memory rows take the largest of every option instead (problem.memory_terms): a constant,
    where this one depends on the choice."""
    temps = [blocks[k].temp_bytes for s in problem.stages_of(r)
             for k, n in enumerate(counts[s]) if n]
    temps += [e.temp_bytes for s in problem.stages_of(r)
              for e, end in zip(ends, (s == 0, s == problem.stages - 1)) if end and e]
    return max(temps, default=0.0)


def rank_memory(costs, problem, counts, sharding, r: int, temp: float) -> tuple:
    """Rank r's predicted peak as plan.MEMORY_PARTS: the static bytes split by the ZeRO level's
    shares, and of the rank's peak forms (ilp.RankParts.peaks) the largest — with lazy
    gradients, either all activation sets and none of those gradients, or all gradients and
    one micro-batch's activations fewer. "other": the largest temporary of the rank's own
    layers (`temp`), what ZeRO's whole-layer buffers add to the peak and the gradients ZB-H1's
    I recorded for W (split_backward "record")."""
    parts = ilp.rank_parts(problem, counts, r)
    both, optimizer = costs.split_static(parts.static, sharding)
    t = costs.training
    fw, fg, _ = sharding.fractions()
    grads = both * t.grad_bytes * fg / (t.weight_bytes * fw + t.grad_bytes * fg)
    g, factors, kept, zero, with_temp = peak_form(problem, counts, r)
    act = sum(f * a for f, a in zip(factors, parts.acts))
    recorded = sum(f * b for f, b in zip(kept, parts.records))
    weights = both - grads
    grads += g * parts.lazy_grads    # the lazy ones absent at an activation peak
    return (weights, grads, optimizer, act, with_temp * temp + zero + recorded)


def solver_text(status: str, gap: float, stop: str = "") -> str:
    """The plan's solver line: "optimal, gap 0.00%", or a stopped search's status and gap, and
    which limit stopped it: the node limit stops it alike in every run, the time limit not."""
    text = f"{status}, gap {gap:.2%}"
    if stop == "time limit":
        return text + ", stopped by the time limit (a rerun may plan differently)"
    return text + (f", stopped by the {stop}" if stop else "")


def read_solver_text(text: str) -> tuple[str, float, str]:
    """(status, gap, stop) of a solver line that solver_text wrote."""
    status, gap, *stop = text.split(", ")
    stop = stop[0].removeprefix("stopped by the ").split(" (")[0] if stop else ""
    return status, float(gap.removeprefix("gap ").rstrip("%")) / 100, stop


def tp_unused(req, tp: int) -> tuple[str, ...]:
    """The note of a tensor-parallel strategy fixed with tp=1 (a sweep's uniform --fix): it
    applies to no block."""
    fixed = Strategy.parse(req.fix.get("strategy", "none"))
    if tp > 1 or not fixed.tp:
        return ()
    return (f"strategy={req.fix['strategy']} at tp=1: no block is tensor-parallel"
            + (f"; its recompute ({fixed.recompute}) applies" if fixed.recompute != "none"
               else ""),)
