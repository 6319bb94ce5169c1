"""runtime.observe.overhead: an action's overhead is its time less the shared work inside it, on
a clock the test advances by hand, so every figure is exact."""
import pytest

from runtime.observe.overhead import STEP, Overhead


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def traced():
    clock = Clock()
    return clock, Overhead(clock)


def test_an_action_is_charged_its_time_less_the_shared_work_inside(traced):
    clock, tracer = traced
    model = tracer.inner(lambda: clock.spend(10.0))

    def forward():
        clock.spend(1.0)
        model()
        clock.spend(2.0)

    action = tracer.span(lambda: {"F": 1}, forward)

    def step():
        clock.spend(0.5)  # outside every action: the step's own
        action()
        action()
        model()           # shared work outside actions is not the step's either

    tracer.step("ours", step)
    assert tracer.per_action() == {("ours", "F"): (2, 6.0), ("ours", STEP): (1, 0.5)}


def test_nested_spans_belong_to_the_outer_one_and_untraced_calls_count_nothing(traced):
    clock, tracer = traced
    inner = tracer.span(lambda: {"send": 1}, lambda: clock.spend(3.0))

    def outer():
        clock.spend(1.0)
        inner()

    action = tracer.span(lambda: {"B": 1}, outer)
    inner()  # no step running: not traced
    tracer.step("ours", action)
    assert tracer.per_action() == {("ours", "B"): (1, 4.0), ("ours", STEP): (1, 0.0)}


def test_a_batch_of_actions_is_shared_out_by_count_and_a_zero_count_charges_time_only(traced):
    clock, tracer = traced
    batch = tracer.span(lambda: {"send": 1, "recv": 3}, lambda: clock.spend(8.0))
    build = tracer.span(lambda: {"recv": 0}, lambda: clock.spend(1.0))
    tracer.step("theirs", lambda: (build(), batch()))
    assert tracer.per_action() == {("theirs", "send"): (1, 2.0), ("theirs", "recv"): (3, 7.0),
                                   ("theirs", STEP): (1, 0.0)}


def test_blocking_only_excludes_the_calls_it_says_block(traced):
    clock, tracer = traced
    collective = tracer.inner(lambda async_op=False: clock.spend(5.0),
                              blocking=lambda async_op=False: not async_op)
    tracer.step("ours", lambda: (collective(), collective(async_op=True)))
    assert tracer.per_action() == {("ours", STEP): (1, 5.0)}


def test_patch_and_restore_put_back_instance_and_class_attributes():
    class Runtime:
        def forward(self):
            return "forward"

    tracer = Overhead()
    runtime = Runtime()
    tracer.patch(runtime, "forward", lambda fn: lambda: "traced " + fn())
    tracer.patch(Runtime, "forward", lambda fn: lambda self: "class")
    assert runtime.forward() == "traced forward"
    tracer.restore()
    assert runtime.forward() == "forward" and "forward" not in vars(runtime)
