"""A plan's whole training step, simulated (runtime.pipeline.step_sim) from the plan's own numbers.

The ILP (planner.search.ilp) prices a pipeline by its schedule's closed form, with one device per rank.
On a cluster that also prices the runtime's own time and cores shared by ranks
(Cluster.runtime_priced: what `fxpar calibrate` measures on CPUs) a plan's prediction is this
simulation instead: every compute action of the schedule with its stage's forward or backward
(plus the runtime's floor per action), the p2p messages, the exposed data-parallel sync, the
optimizer step and the runtime's overheads, on `cluster.cores` cores shared by all the plan's
ranks; an action of a stage with tensor-parallel layers also wakes its group once. `fxpar bench
--explain` lines the same parts up with a measured step.
"""
from __future__ import annotations

import math
from dataclasses import replace

from cost_model.hardware.cluster import Cluster
from cost_model.hardware.comm import collective_time, ring_steps
from planner.search.plan import Plan, Predicted
from runtime.pipeline.generators import make_schedule
from runtime.pipeline.schedule import Action, Kind, Schedule
from runtime.pipeline.step_sim import StepCosts, StepTimeline, simulate_step
from runtime.training.loss_tokens import LOCAL_COUNTS

COMPUTE = tuple(k.value for k in (Kind.F, Kind.B, Kind.I, Kind.W))


def step_costs(plan: Plan, cluster: Cluster) -> tuple[Schedule, StepCosts]:
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    floor = cluster.action_floor
    split = 0.0 if plan.split_backward == "record" else cluster.split_backward
    woken = [_tp_wake_up(plan, stage, cluster) for stage in plan.stages]

    def duration(action: Action) -> float:
        stage = plan.stages[action.stage]
        wake = woken[action.stage] if action.kind is not Kind.W else 0.0
        if action.kind is Kind.F:
            return stage.fwd_s + floor + wake
        if action.kind is Kind.B:
            return stage.bwd_s + floor + wake
        if action.stage == 0:  # no boundary input: I has nothing to compute, W is a plain backward
            return floor + (stage.bwd_s + wake if action.kind is Kind.W else 0.0)
        return stage.bwd_s * (1 + split) / 2 + floor + wake  # I or W: half of a longer backward

    optimizer = [sum(plan.stages[s].step_s for s in schedule.stages_of(r))
                 for r in range(plan.pp)]
    p, replicas = plan.predicted, plan.dp * plan.tp * plan.cp
    # a message's hand-off as measured (post, wire, wake-up), if slower than the wire alone;
    # posted while every core is busy, as measured then
    p2p = max(p.p2p_s, cluster.p2p_handoff) if plan.pp > 1 else 0.0
    shared_p2p = max(p.p2p_s, cluster.shared_p2p_handoff) if cluster.shared_p2p_handoff else 0.0
    # the data-parallel sync's group idled through the stage's computing
    syncs = _woken(p.rank_sync_s, cluster) or 0.0
    return schedule, StepCosts(duration, p2p, cluster.action_overhead, cluster.step_overhead,
                               syncs, optimizer, replicas,
                               cluster.cores or math.inf, cluster.unshared_ranks,
                               cluster.send_overhead, *_step_syncs(plan, cluster, replicas),
                               send_wait_s=cluster.shared_send_wait, shared_p2p_s=shared_p2p,
                               recv_overhead_s=cluster.recv_overhead)


def _tp_wake_up(plan: Plan, stage, cluster: Cluster) -> float:
    """What an action of a stage with tensor-parallel layers pays beyond their priced
    collectives: its first all-reduce wakes a group that idled since the stage's last action
    (other stages' actions, p2p waits, the layers without collectives before it), so it takes
    a collective reached after a stage's computing (sync_handoff) rather than after a layer's
    (collective_handoff, already in each collective's price). W reaches none (its weight
    gradients need no all-reduce)."""
    if plan.tp < 2 or not any(s == "vocab-tp" or "tp" in s.split("+") for s in stage.strategies):
        return 0.0
    return max(0.0, cluster.sync_handoff - cluster.collective_handoff)


def _step_syncs(plan: Plan, cluster: Cluster, replicas: int) -> tuple[float, float]:
    """(start, finish): the all-reduce checking every rank got the same batch
    (runtime.training.batch.compare_batches) and, over the replicas, the one counting the step's targets
    for a mean loss, where there are too many replicas' micro-batches for each rank to count them
    all in the batch it checked (runtime.training.loss_tokens.LOCAL_COUNTS); the loss's way from the last stage to every rank
    (the trainer's broadcast over the pipeline, an all-reduce over the replicas). Each side
    wakes groups that idled through the step (sync_handoff) unless sync_latency, measured as a
    step reaches them, already holds that."""
    world, group = replicas * plan.pp, plan.dp * plan.cp
    start = _small_all_reduce(cluster, 16, world)
    finish = _small_all_reduce(cluster, 4, plan.pp, stride=replicas)
    if group > 1 and group * plan.num_microbatches > LOCAL_COUNTS:
        start += _small_all_reduce(cluster, 4, group, stride=plan.tp)
    if group > 1:
        finish += _small_all_reduce(cluster, 4, group, stride=plan.tp)
    return (start, finish) if cluster.sync_latency else _woken((start, finish), cluster)


def _small_all_reduce(cluster: Cluster, nbytes: int, n: int, stride: int = 1) -> float:
    """One of the step's own all-reduces over n ranks: as measured in a step, wake-up included
    (Cluster.sync_latency), where calibrated; else by the links (and woken by the caller)."""
    if n < 2:
        return 0.0
    if cluster.sync_latency:
        return ring_steps("all_reduce", n) * cluster.sync_latency
    return collective_time(cluster, "all_reduce", nbytes, n, stride=stride)


def _woken(times, cluster: Cluster) -> tuple[float, ...]:
    """Each of the step's own collectives (a non-zero time) plus the wake-up of its groups,
    which idled through the step's computing (Cluster.sync_handoff)."""
    return tuple(t + cluster.sync_handoff if t else 0.0 for t in times)


def predicted_step(plan: Plan, cluster: Cluster) -> StepTimeline:
    return simulate_step(*step_costs(plan, cluster))


def simulated(plan: Plan, cluster: Cluster, flops: float) -> Predicted:
    """The plan's Predicted with the simulated step: the iteration, and on the busiest rank
    (most compute) its compute, exposed communication, bubble (p2p waits and idle) and the
    rest (optimizer, the runtime's own time)."""
    step = predicted_step(plan, cluster)
    busiest = max(step.parts, key=lambda parts: sum(parts.get(k, 0.0) for k in parts
                                                    if k[0] in COMPUTE))
    compute = sum(v for k, v in busiest.items() if k[0] in COMPUTE)
    bubble = busiest.get("p2p wait", 0.0) + busiest.get("idle", 0.0)
    comm = busiest.get("dp sync", 0.0)
    iteration = step.makespan
    p = plan.predicted
    return replace(p, iteration_s=iteration, compute_s=compute, comm_s=comm, bubble_s=bubble,
                   bubble_fraction=bubble / compute if compute else 0.0,
                   tokens_per_s=plan.global_batch * plan.seq / iteration,
                   tflops_per_gpu=flops / iteration / plan.gpus / 1e12,
                   runtime_s=iteration - compute - comm - bubble)
