"""Pipeline-schedule IR, generators, text forms and validator."""

import pytest

from runtime.pipeline import generators
from runtime.pipeline.generators import (inflight_moments, interleaved_1f1b, make_schedule,
                                         one_f_one_b, schedule_error, zb_h1)
from runtime.pipeline.schedule import Action, Kind, Schedule, ScheduleError
from runtime.pipeline.simulator import grid, simulate
from runtime.pipeline.validate import validate

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def _build(name: str, p: int, m: int) -> Schedule:
    return make_schedule(name, p, m, v=2 if name == "interleaved-1f1b" else 1)


# -- text forms ------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("stage, mb", [(0, 0), (3, 12), (15, 7)])
def test_action_text_round_trip(kind, stage, mb):
    action = Action(stage, kind, mb)
    assert Action.parse(str(action)) == action


def test_action_text_examples():
    assert str(Action(2, Kind.F, 0)) == "2F0"
    assert str(Action(3, Kind.SEND_F, 2)) == "3SEND_F2"
    assert Action.parse("1RECV_B0") == Action(1, Kind.RECV_B, 0)
    assert Action(1, "W", 2) == Action(1, Kind.W, 2)  # kind given as text
    assert Action(0, Kind.I, 0).is_compute and not Action(0, Kind.SEND_B, 0).is_compute


@pytest.mark.parametrize("text", ["", "F0", "0F", "0X1", "a0F1", "0F-1", "0SEND1", "0 F 1"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="bad action"):
        Action.parse(text)


@pytest.mark.parametrize("name", NAMES)
def test_schedule_text_round_trip(name):
    sched = _build(name, 4, 8)
    text = str(sched)
    assert text.splitlines()[1].startswith("rank 0: ")
    assert Schedule.parse(text) == sched


def test_parse_without_header_infers_sizes():
    sched = Schedule.parse("rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n")
    assert (sched.name, sched.num_ranks, sched.num_stages, sched.num_microbatches) == ("custom", 2, 2, 1)
    validate(sched)


def test_parse_errors_name_the_line():
    with pytest.raises(ValueError, match="line 2: bad action 'F1'"):
        Schedule.parse("rank 0: 0F0\nrank 1: F1")
    with pytest.raises(ValueError, match="line 1: expected"):
        Schedule.parse("ranks 0 0F0")
    with pytest.raises(ValueError, match="ranks must be listed as 0..n-1"):
        Schedule.parse("rank 1: 1F0")


def test_interleaved_placement_loops_over_ranks():
    sched = interleaved_1f1b(2, 4, v=3)
    assert sched.num_stages == 6
    assert [sched.stage_to_rank(s) for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert sched.stages_of(1) == (1, 3, 5)


def test_1f1b_grid_golden():
    expected = """\
rank 0: 0F0 0F1 0F2 0F3 .   .   .   0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 .   0B5 .   0B6 .   0B7
rank 1: .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 .   1B6 .   1B7 .
rank 2: .   .   2F0 2F1 .   2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 .   2B7 .   .
rank 3: .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 .   .   ."""
    assert grid(one_f_one_b(4, 8)) == expected


# -- generators --------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_generators_produce_valid_schedules(name, p, factor):
    sched = _build(name, p, factor * p)
    validate(sched)
    assert sched.name == name and sched.num_ranks == p


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p, m", [(4, 1), (4, 3), (3, 5)])
def test_generators_handle_m_not_multiple_of_p(name, p, m):
    validate(make_schedule(name, p, m))


@pytest.mark.parametrize("p, m", [(1, 1), (2, 5), (4, 2), (4, 4), (4, 8), (8, 16)])
def test_1f1b_warmup_and_peak_inflight(p, m):
    sched = one_f_one_b(p, m)
    for r, acts in enumerate(sched.actions):
        compute = [a.kind for a in acts if a.is_compute]
        # min(p - r - 1, m) warm-up forwards, plus the steady forward when there is one
        assert compute.index(Kind.B) == min(p - r, m)
    assert simulate(sched, {"F": 1, "B": 2}).peak_inflight == tuple(min(p - r, m) for r in range(p))


def test_zb_h1_matches_1f1b_peak_memory():
    for p, m in [(2, 8), (4, 16), (4, 3)]:
        zb = simulate(zb_h1(p, m), {"F": 1, "I": 1, "W": 1}).peak_inflight
        ofob = simulate(one_f_one_b(p, m), {"F": 1, "B": 2}).peak_inflight
        assert max(zb) == max(ofob)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_schedule("1f1b", 0, 4), "p .* >= 1"),
        (lambda: make_schedule("gpipe", 2, 0), "m .* >= 1"),
        (lambda: make_schedule("interleaved-1f1b", 2, 4, v=0), "v .* >= 1"),
        (lambda: make_schedule("1f1b", 2.0, 4), "p .* integer"),
        (lambda: make_schedule("interleaved-1f1b", 4, 6, v=2), "multiple of the rank count: m=6, p=4"),
        (lambda: make_schedule("1f1b", 2, 4, v=2), "one stage per rank"),
        (lambda: make_schedule("pipedream", 2, 4), "unknown schedule 'pipedream'"),
    ],
)
def test_generator_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- validator ---------------------------------------------------------------

GOOD = """
schedule custom: ranks=2 stages=2 microbatches=2
rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
"""


def _with_rank(text: str, rank: int, row: str) -> Schedule:
    lines = [ln for ln in text.strip().splitlines() if not ln.startswith(f"rank {rank}:")]
    return Schedule.parse("\n".join(lines + [f"rank {rank}: {row}"]))


def _rejects(sched: Schedule, *fragments: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_good_hand_written_schedule_passes():
    validate(Schedule.parse(GOOD))
    assert issubclass(ScheduleError, ValueError)


def test_missing_receive_is_reported_at_the_send():
    sched = _with_rank(GOOD, 1, "1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1")
    _rejects(sched, "rank 0", "0SEND_F1 has no matching 1RECV_F1 on rank 1")


def test_missing_send_is_reported_at_the_receive():
    sched = _with_rank(GOOD, 0, "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1")
    _rejects(sched, "rank 1: 1RECV_F1 has no matching 0SEND_F1 on rank 0")


def test_action_before_its_dependency():
    sched = _with_rank(GOOD, 1, "1RECV_F0 1F0 1B0 1SEND_B0 1F1 1RECV_F1 1B1 1SEND_B1")
    _rejects(sched, "rank 1: 1F1 runs before 1RECV_F1")
    sched = _with_rank(GOOD, 0, "0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1")
    _rejects(sched, "rank 0: 0SEND_F0 runs before 0F0")


def test_weight_gradient_before_input_gradient():
    text = str(zb_h1(1, 2)).replace("0I1 0W1", "0W1 0I1")
    _rejects(Schedule.parse(text), "rank 0: 0W1 runs before 0I1")


def test_missing_and_duplicated_compute():
    _rejects(_with_rank(GOOD, 1, "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1SEND_B1"),
             "rank 1: stage 1 micro-batch 1 has no backward")
    _rejects(_with_rank(GOOD, 0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0B1"),
             "rank 0: 0B1 appears 2 times")
    no_w = Schedule.parse(str(zb_h1(1, 2)).replace(" 0W1", ""))
    _rejects(no_w, "micro-batch 1 has a split backward without W")


def test_action_on_the_wrong_rank():
    sched = _with_rank(GOOD, 0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 1F0")
    _rejects(sched, "rank 0: 1F0 belongs to stage 1, which lives on rank 1")


def test_deadlock_names_each_blocked_rank():
    sched = Schedule.parse(
        "rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\n"  # waits for the gradient before sending the activation
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n"
    )
    message = _rejects(sched, "deadlock")
    assert "rank 0 waits at 0B0 for 1SEND_B0 from rank 1" in message
    assert "rank 1 waits at 1F0 for 0SEND_F0 from rank 0" in message


def test_receives_out_of_send_order():
    sched = _with_rank(GOOD, 1, "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1")
    _rejects(sched, "rank 1: 1RECV_F1 is posted where rank 0's next message to rank 1 is for 1RECV_F0")


def test_schedule_shape_is_checked():
    with pytest.raises(ValueError, match="1 action lists for 2 ranks"):
        Schedule("x", 2, 2, 1, [[Action(0, Kind.F, 0)]])
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        Schedule("x", 2, 3, 1, [[], []])


@pytest.mark.parametrize("name, v, records", [("1f1b", 1, False), ("zb-h1", 1, False),
                                              ("zb-h1", 1, True), ("interleaved-1f1b", 2, False),
                                              ("interleaved-1f1b", 3, False)])
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_moments_past_the_steady_state_are_those_of_2p_micro_batches(name, v, records, p):
    """inflight_moments counts a step of many micro-batches as one of 2p (the steady state
    repeats): the whole schedule's moments agree at every legal count up to 6p."""
    for m in range(2 * p + 1, 6 * p + 1):
        if schedule_error(name, p, m, v) is None:
            assert inflight_moments(name, p, m, v, records) == \
                generators._moments(name, p, m, v, records), m
