"""runtime.pipeline.step_sim against runtime.pipeline.simulator (own devices) and against hand-worked and
conservation facts on shared cores."""
import math
import random

import pytest

from runtime.pipeline.generators import make_schedule
from runtime.pipeline.simulator import simulate
from runtime.pipeline.step_sim import StepCosts, simulate_step

SCHEDULES = [("gpipe", 3, 4, 1), ("1f1b", 4, 6, 1), ("zb-h1", 3, 5, 1),
             ("interleaved-1f1b", 2, 4, 2)]


def _durations(seed: int):
    rng = random.Random(seed)
    table = {}

    def duration(action):
        key = (action.kind.value, action.stage)
        return table.setdefault(key, rng.uniform(0.5, 2.0))
    return duration


@pytest.mark.parametrize("name,p,m,v", SCHEDULES)
def test_own_devices_and_no_overheads_equal_the_schedule_simulator(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    duration = _durations(p * 10 + m)
    want = simulate(schedule, duration, p2p_time=0.3)
    got = simulate_step(schedule, StepCosts(duration, p2p_s=0.3))
    assert got.makespan == pytest.approx(want.makespan)
    assert [(e.rank, str(e.action)) for e in got.timeline.events] == \
        [(e.rank, str(e.action)) for e in want.events]
    assert [t for e in got.timeline.events for t in (e.start, e.end)] == \
        pytest.approx([t for e in want.events for t in (e.start, e.end)])


@pytest.mark.parametrize("name,p,m,v", SCHEDULES)
def test_parts_add_up_to_the_makespan_on_every_rank(name, p, m, v):
    schedule = make_schedule(name, p, m, v)
    costs = StepCosts(_durations(3), p2p_s=0.2, action_overhead_s=0.05, setup_s=0.3,
                      sync_s=[0.1 * r for r in range(p)], optimizer_s=0.4, replicas=2, cores=3)
    step = simulate_step(schedule, costs)
    for parts in step.parts:
        assert sum(parts.values()) == pytest.approx(step.makespan)


@pytest.mark.parametrize("name,p,m,v", SCHEDULES)
def test_one_core_runs_all_the_work_one_rank_at_a_time(name, p, m, v):
    """With p2p = 0 some rank can always work, so on one core the step takes the sum of every
    rank's CPU time."""
    schedule = make_schedule(name, p, m, v)
    duration = _durations(7)
    costs = StepCosts(duration, action_overhead_s=0.01, setup_s=0.1, optimizer_s=0.2,
                      cores=1)
    work = sum(duration(a) + 0.01 for acts in schedule.actions for a in acts if a.is_compute)
    assert simulate_step(schedule, costs).makespan == pytest.approx(work + p * 0.3)


def test_two_stages_on_one_core_by_hand():
    """GPipe p=2 m=2, F = B = 1: rank 0's second forward and rank 1's first share the core
    (both end at 3); so do the two backwards after 5 (both end at 7); the step ends at 8."""
    step = simulate_step(make_schedule("gpipe", 2, 2), StepCosts(lambda a: 1.0, cores=1))
    spans = {(e.rank, str(e.action)): (e.start, e.end) for e in step.timeline.events}
    assert spans[0, "0F1"] == (1.0, 3.0) and spans[1, "1F0"] == (1.0, 3.0)
    assert spans[1, "1B1"] == (5.0, 7.0) and spans[0, "0B0"] == (5.0, 7.0)
    assert step.makespan == 8.0


def test_replicas_share_the_cores():
    """One stage, its 4 data-parallel copies on 2 cores: every action takes twice as long."""
    schedule = make_schedule("1f1b", 1, 3)
    alone = simulate_step(schedule, StepCosts(lambda a: 1.0, optimizer_s=0.5))
    shared = simulate_step(schedule, StepCosts(lambda a: 1.0, optimizer_s=0.5, replicas=4,
                                               cores=2))
    assert shared.makespan == pytest.approx(2 * alone.makespan) == pytest.approx(13.0)
    assert shared.parts[0]["optimizer"] == pytest.approx(1.0)


def test_a_sync_on_shared_cores_slows_as_compute_does():
    """1F1B p=2 m=1 on one core, F = B = 1, rank 1's sync 2 s: a CPU rank's collective reduces
    and copies on its cores. Rank 1's sync (from 3) shares the core with rank 0's backward (3 to
    5), then with rank 0's optimizer step (5 to 7); rank 1's own step then runs alone (7 to 8).
    With a core per rank the sync takes its own 2 s."""
    schedule = make_schedule("1f1b", 2, 1)
    shared = simulate_step(schedule, StepCosts(lambda a: 1.0, sync_s=[0.0, 2.0], optimizer_s=1.0,
                                               cores=1))
    assert shared.parts[1]["dp sync"] == pytest.approx(4.0)
    assert shared.parts[0]["optimizer"] == pytest.approx(2.0)
    assert shared.makespan == pytest.approx(8.0)
    own = simulate_step(schedule, StepCosts(lambda a: 1.0, sync_s=[0.0, 2.0], optimizer_s=1.0))
    assert own.parts[1]["dp sync"] == pytest.approx(2.0)
    assert own.makespan == pytest.approx(3 + 2 + 1)  # its backward ends at 3


def test_ranks_measured_not_to_slow_each_other_run_at_full_speed():
    """Two busy ranks unshared, four sharing 1.5 cores: the same one-stage schedule takes its
    own time with 2 replicas and 4 / 1.5 of it with 4."""
    schedule = make_schedule("1f1b", 1, 2)
    alone = simulate_step(schedule, StepCosts(lambda a: 1.0)).makespan
    two = simulate_step(schedule, StepCosts(lambda a: 1.0, replicas=2, cores=1.5, unshared=2))
    four = simulate_step(schedule, StepCosts(lambda a: 1.0, replicas=4, cores=1.5, unshared=2))
    assert two.makespan == pytest.approx(alone)
    assert four.makespan == pytest.approx(alone * 4 / 1.5)


def test_ranks_slowed_by_a_shared_cache_still_have_a_core_each():
    """Two pipeline ranks measured 10% slower together (cores 2 / 1.1) compute at that speed
    when both are busy, but a post does not wait for a core: each has one to be woken on."""
    schedule = make_schedule("1f1b", 2, 4)
    costs = dict(duration=lambda a: 1.0, cores=2 / 1.1, send_wait_s=5.0)
    step = simulate_step(schedule, StepCosts(**costs))
    alone = simulate_step(schedule, StepCosts(lambda a: 1.0))
    assert alone.makespan < step.makespan < alone.makespan * 1.1
    crowded = simulate_step(schedule, StepCosts(**{**costs, "cores": 1.0}))
    assert crowded.makespan > step.makespan + 5.0  # one core: posts wait for it


def test_a_received_message_costs_its_receiver_cpu_once_there():
    """1F1B p=2 m=2, F = B = 1: rank 1 receives two forwards and rank 0 two gradients. On
    one core (p2p = 0, so some rank can always work) each receive's CPU adds to the step; with
    a device per rank each rank's "overhead" is its own receives' CPU."""
    schedule = make_schedule("1f1b", 2, 2)
    receives = [sum(schedule.recv_for(a) is not None for a in acts if a.is_compute)
                for acts in schedule.actions]
    assert receives == [2, 2]
    one_core = dict(duration=lambda a: 1.0, cores=1)
    plain = simulate_step(schedule, StepCosts(**one_core)).makespan
    costly = simulate_step(schedule, StepCosts(**one_core, recv_overhead_s=0.25)).makespan
    assert costly == pytest.approx(plain + 4 * 0.25)
    own = simulate_step(schedule, StepCosts(lambda a: 1.0, recv_overhead_s=0.25))
    assert [parts["overhead"] for parts in own.parts] == pytest.approx([0.5, 0.5])
