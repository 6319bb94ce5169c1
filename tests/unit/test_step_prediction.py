"""Plans on clusters that price the runtime's own time (calibrated CPU profiles) are predicted by
simulating the whole step (planner.search.step_prediction); presets keep the ILP's closed form."""
import dataclasses

import pytest

from planner.bench.runtime_probes import (cores_from_slowdown, per_tensor_and_param, runtime_terms,
                                   slope_through_origin)
from cost_model.hardware.cluster import PRESETS
from planner.api import plan
from planner.models.presets import get_config
from planner.search.step_prediction import _step_syncs, predicted_step, step_costs
from runtime.pipeline.schedule import Action, Kind
from runtime.training.loss_tokens import LOCAL_COUNTS

CPU = PRESETS["cpu-gloo"]
TINY = get_config("gpt-tiny")


def _plan(cluster, **fix):
    return plan(TINY, 4, cluster=cluster, fix=fix)[0]


def test_presets_keep_the_closed_form():
    assert not any(c.runtime_priced for c in PRESETS.values())
    p = _plan(CPU, pp=2, dp=2, schedule="1f1b")
    assert p.predicted.runtime_s == 0.0
    assert p.stages[0].fwd_s > 0 and p.stages[0].bwd_s > p.stages[0].fwd_s * 0.5


def test_a_priced_runtime_predicts_the_simulated_step():
    cluster = dataclasses.replace(CPU, action_overhead=2e-4, step_overhead=1e-3,
                                  optimizer_per_tensor=1e-5, optimizer_per_param=1e-9)
    p = _plan(cluster, pp=2, dp=2, schedule="1f1b")
    step = predicted_step(p, cluster)
    assert p.predicted.iteration_s == pytest.approx(step.makespan)
    assert all(sum(parts.values()) == pytest.approx(step.makespan) for parts in step.parts)
    assert all(parts["optimizer"] > 0 for parts in step.parts)
    neutral = predicted_step(p, dataclasses.replace(CPU, cores=0.0))
    assert p.predicted.iteration_s > neutral.makespan + 1e-3  # the step's set-up at least
    assert p.predicted.runtime_s > 1e-3


def test_without_a_pipeline_the_simulation_is_the_closed_form():
    """pp = 1: m forward-backward pairs then the exposed sync, exactly what the ILP sums (with a
    pipeline the ILP's closed form approximates the schedule; the simulation plays it out)."""
    cluster = dataclasses.replace(CPU, step_overhead=1e-12, optimizer_per_tensor=1e-5)
    for fix in (dict(dp=4), dict(dp=2, tp=2, mb=2)):
        simulated = _plan(cluster, **fix)
        stage, p = simulated.stages[0], simulated.predicted
        closed = simulated.num_microbatches * stage.time_s + p.rank_sync_s[0] + stage.step_s
        start, finish = _step_syncs(simulated, cluster, simulated.dp * simulated.tp)
        assert start > 0 and finish > 0  # the step's batch check and loss, priced as all-reduces
        assert p.iteration_s - start - finish == pytest.approx(closed)


@pytest.mark.parametrize("fix, woken", [(dict(dp=4), 3), (dict(pp=4, schedule="1f1b"), 2),
                                        (dict(dp=2, pp=2, schedule="1f1b"), 3)])
def test_the_steps_own_collectives_pay_the_sync_handoff_once_each(fix, woken):
    """The opening check, the data-parallel sync (with replicas) and the loss's all-reduce (with
    replicas or stages) each wake groups that idled through the step: the step is longer by
    sync_handoff per one of them on the critical path."""
    cluster = dataclasses.replace(CPU, action_overhead=2e-4, step_overhead=1e-3)
    p = _plan(cluster, **fix)
    base = predicted_step(p, cluster).makespan
    woke = predicted_step(p, dataclasses.replace(cluster, sync_handoff=1e-2)).makespan
    assert woke - base == pytest.approx(woken * 1e-2)


def test_measured_step_syncs_are_priced_per_ring_step_wake_up_included():
    """With sync_latency calibrated each of the step's own all-reduces over n ranks takes
    2 (n - 1) of it, its wake-up included (sync_handoff no longer added): on dp=2 x pp=2, the
    world's check (6 ring steps) opens the step (each rank counts the replicas' targets itself);
    the loss over the stages (2) and the replicas (2) close it."""
    cluster = dataclasses.replace(CPU, sync_latency=1e-3, sync_handoff=5e-3)
    p = _plan(cluster, dp=2, pp=2, schedule="1f1b")
    assert 2 * p.num_microbatches <= LOCAL_COUNTS
    start, finish = _step_syncs(p, cluster, 2)
    assert (start, finish) == (pytest.approx(6e-3), pytest.approx(4e-3))


def test_the_step_sync_fit_is_least_squares_through_the_origin():
    """slope_through_origin against a brute-force search over slopes."""
    xs, ys = [6.0, 18.0], [5.1e-3, 16.2e-3]
    best = min((sum((y - k * 1e-7 * x) ** 2 for x, y in zip(xs, ys)), k * 1e-7)
               for k in range(20000))[1]
    assert slope_through_origin(xs, ys) == pytest.approx(best, abs=1e-7)


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_replicas_count_the_steps_targets_at_the_start(micro_batch):
    """A mean loss's target count: each rank counts every replica's micro-batches itself up to
    LOCAL_COUNTS of them, beyond that it is all-reduced over the replicas as the step starts
    (runtime.training.loss_tokens): one more small all-reduce than the batch check alone."""
    from cost_model.hardware.comm import collective_time
    p = _plan(CPU, dp=4, mb=micro_batch)
    start, _ = _step_syncs(p, CPU, 4)
    check = collective_time(CPU, "all_reduce", 16, 4)
    counted_apart = 4 * p.num_microbatches > LOCAL_COUNTS
    assert counted_apart == (micro_batch == 1)  # both cases are met
    assert start == pytest.approx(check + counted_apart * collective_time(CPU, "all_reduce", 4, 4))


def test_ranks_sharing_cores_slow_each_other():
    """Four data-parallel ranks on two cores compute at half speed; on four, at full speed."""
    shared = dataclasses.replace(CPU, cores=2.0)
    own = dataclasses.replace(CPU, cores=4.0)
    p = _plan(shared, dp=4)
    two = predicted_step(p, shared).parts[0]
    four = predicted_step(p, own).parts[0]
    assert two["F0"] == pytest.approx(2 * four["F0"])
    assert two["B0"] == pytest.approx(2 * four["B0"])


def test_zb_h1_pays_the_second_traversal():
    cluster = dataclasses.replace(CPU, split_backward=0.5)
    p = _plan(cluster, pp=2, dp=2, schedule="zb-h1", split_backward="retraverse")
    parts = predicted_step(p, cluster).parts[1]
    m = p.num_microbatches
    assert parts["I1"] + parts["W1"] == pytest.approx(1.5 * m * p.stages[1].bwd_s)


def test_zb_h1s_first_stage_runs_one_plain_backward():
    """Stage 0 has no boundary input: the executor's I computes nothing and its W is a whole
    backward, so stage 0 pays no second traversal. The schedule's makespan stays the closed form
    of the ILP (the simulator, with F = 1 and B = 2 split that way on stage 0 only)."""
    from planner.search.ilp import schedule_weights
    from runtime.pipeline.generators import make_schedule
    from runtime.pipeline.simulator import simulate
    cluster = dataclasses.replace(CPU, split_backward=0.5)
    p = _plan(cluster, pp=2, dp=2, schedule="zb-h1", split_backward="retraverse")
    parts = predicted_step(p, cluster).parts[0]
    m = p.num_microbatches
    assert parts["I0"] + parts["W0"] == pytest.approx(m * p.stages[0].bwd_s)
    for pp, mb in [(2, 4), (4, 8), (8, 32)]:
        def seconds(a):
            if a.kind is Kind.F:
                return 1.0
            return (0.0 if a.kind is Kind.I else 2.0) if a.stage == 0 else 1.0
        timeline = simulate(make_schedule("zb-h1", pp, mb), seconds)
        assert max(e.end for e in timeline.events) == pytest.approx(
            3.0 * schedule_weights("zb-h1", pp, mb)[1])


def test_optimizer_fit_recovers_both_costs():
    a, b = 3e-6, 2e-9
    shapes = [(256, 256), (4, 2**18)]
    times = [n * a + n * s * b for n, s in shapes]
    assert per_tensor_and_param(shapes[0], times[0], shapes[1], times[1]) == \
        pytest.approx((a, b))


def test_cores_from_slowdown():
    assert cores_from_slowdown(4, 2.0) == 2.0
    assert cores_from_slowdown(4, 1.03) == 0.0  # noise: a core per rank
    assert cores_from_slowdown(2, 1.1) == pytest.approx(2 / 1.1)  # a shared cache, measured


def test_runtime_terms_split_what_actions_take_beyond_their_price_per_op_and_per_action():
    """Probes of two depths, two micro-batch counts: an F or a B takes its priced compute plus
    action_floor plus ops x op_overhead; the step's overhead part is step_overhead plus
    actions x action_overhead. The fit recovers the four from exact data."""
    floor, per_op, per_action, per_step = 2e-4, 3e-6, 4e-5, 1e-4
    runs = {}
    for m in (2, 8):
        for layers, ops in ((2, 69), (6, 173)):
            fwd, bwd = 1e-3 * layers / m, 2e-3 * layers / m
            gap = floor + ops * per_op
            parts = {"F0": m * (fwd + gap), "B0": m * (bwd + gap),
                     "overhead": per_step + 2 * m * per_action}
            runs[(m, layers)] = (parts, fwd, bwd, ops)
    terms = runtime_terms(runs)
    assert terms == pytest.approx(dict(op_overhead=per_op, action_floor=floor,
                                       action_overhead=per_action, step_overhead=per_step))
    # a noisy probe whose deeper stage seems cheaper per op cannot price ops below zero
    runs[(2, 6)][0]["F0"] = runs[(2, 2)][0]["F0"]
    runs[(8, 6)][0]["F0"] = runs[(8, 2)][0]["F0"]
    runs[(2, 6)][0]["B0"] = runs[(2, 2)][0]["B0"] * 0.5
    runs[(8, 6)][0]["B0"] = runs[(8, 2)][0]["B0"] * 0.5
    noisy = runtime_terms(runs)
    assert noisy["op_overhead"] >= 0 and noisy["action_floor"] >= 0


def test_a_post_among_busy_cores_waits_for_its_core_and_hands_off_slower():
    """A post made while more ranks want CPU than run unshared on the cores waits (no CPU) for
    the core its woken receiver took, and its message takes the hand-off measured with every
    core busy. Posts among idle cores keep the terms measured so."""
    base = dataclasses.replace(CPU, cores=2.0, unshared_ranks=2.0, p2p_handoff=1e-4,
                               send_overhead=1e-4)
    shared = dataclasses.replace(base, shared_send_wait=5e-4, shared_p2p_handoff=2e-3)
    # two pipelines of 4 micro-batches on 4 ranks: stage 0 posts while stage 1 computes
    busy = _plan(base, pp=2, dp=2, schedule="1f1b", mb=2)
    before, after = predicted_step(busy, base), predicted_step(busy, shared)
    sends = sum(1 for a in _schedule_actions(busy, 0) if a.kind.is_send)
    # some posts waited (the other CPU overhead shifts a little with the sharing)
    waited = (after.parts[0]["overhead"] - before.parts[0]["overhead"]) / 5e-4
    assert 0.5 < waited < sends + 0.5
    assert after.makespan > before.makespan
    # one micro-batch: every post finds the other stage waiting, so nothing changes
    lockstep = _plan(base, pp=2, dp=2, schedule="1f1b", mb=8)
    assert lockstep.num_microbatches == 1
    assert predicted_step(lockstep, shared).makespan == \
        pytest.approx(predicted_step(lockstep, base).makespan)
    # two ranks run unshared: never crowded
    two = plan(TINY, 2, cluster=base, fix=dict(pp=2, schedule="1f1b"))[0]
    assert predicted_step(two, shared).makespan == pytest.approx(predicted_step(two, base).makespan)


def _schedule_actions(p, rank):
    from runtime.pipeline.generators import make_schedule
    return make_schedule(p.schedule, p.pp, p.num_microbatches, p.virtual_stages).actions[rank]


def test_an_action_of_a_tensor_parallel_stage_wakes_its_group_once():
    cluster = dataclasses.replace(CPU, action_overhead=2e-4, collective_handoff=1e-4)
    p = _plan(cluster, tp=2, pp=2, dp=1, schedule="zb-h1")
    stages = (dataclasses.replace(p.stages[0], strategies=("none",) * len(p.stages[0].layers)),
              dataclasses.replace(p.stages[1], strategies=("tp",) * len(p.stages[1].layers)))
    p = dataclasses.replace(p, stages=stages)
    asleep = dataclasses.replace(cluster, sync_handoff=2.1e-3)
    _, quiet = step_costs(p, cluster)
    _, woken = step_costs(p, asleep)
    for kind, paid in ((Kind.F, 2e-3), (Kind.B, 2e-3), (Kind.I, 2e-3), (Kind.W, 0.0)):
        before = quiet.duration(Action(0, kind, 1))
        assert woken.duration(Action(0, kind, 1)) == pytest.approx(before)
        assert woken.duration(Action(1, kind, 1)) == pytest.approx(
            quiet.duration(Action(1, kind, 1)) + paid)
    vocab = dataclasses.replace(p, stages=(stages[0], dataclasses.replace(
        stages[1], strategies=("none",) * (len(stages[1].layers) - 1) + ("vocab-tp",))))
    assert step_costs(vocab, asleep)[1].duration(Action(1, Kind.F, 0)) == pytest.approx(
        step_costs(vocab, cluster)[1].duration(Action(1, Kind.F, 0)) + 2e-3)
