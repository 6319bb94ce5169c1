"""A pipeline runtime's own overhead per action: what is left of an action's time once the work
it hands to others is taken out.

An action (F, B, I, W, a send, a receive) is timed from the moment the runtime enters it until
it leaves it, in CPU time of the rank's thread (time.thread_time: a rank descheduled on a busy
host is not overhead, and a blocked wait sleeps). From that time the tracer subtracts the time
spent *inside* the work both runtimes share: the stage program's forward, autograd's backward /
grad, the optimizer's step, and every blocking wait on communication (Work.wait and the
synchronous collectives). What remains is the runtime's own Python and the cost of posting its
operations. Whatever of a training step lies outside every action (setting up the step, waiting
for the last sends, handing out the loss, scaling gradients) is counted as one more kind,
"step", once per step.

Usage: `tracer.span(kind_of, fn)` wraps a runtime's entry point for an action (kind_of(*args,
**kwargs) -> {kind: count}: a call may carry several actions, e.g. a batch of sends and
receives, whose time is shared out by count; a count of 0 charges time to a kind without
counting an action); `tracer.inner(fn)` wraps shared work; `tracer.patch(owner, name, wrap)`
installs a wrapper and remembers how to undo it; `tracer.step(side, fn)` runs one training step
of one side. Wrappers cost about a microsecond a call, on both sides alike.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Callable

STEP = "step"


class Overhead:
    """Per (side, kind): actions counted and overhead seconds, summed over the traced steps."""

    def __init__(self, clock: Callable[[], float] = time.thread_time):
        self.clock = clock
        self.count: dict[tuple[str, str], float] = defaultdict(float)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.side: str | None = None  # whose step is running; None: not tracing
        self._span_depth = 0
        self._inner_depth = 0
        self._excluded = 0.0  # inner time of the open span, or of the step outside spans
        self._spans_wall = 0.0  # wall time of this step's spans
        self._undo: list[Callable[[], None]] = []

    # -- wrappers ------------------------------------------------------------------------------
    def span(self, kind_of: Callable[..., dict[str, float]], fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if self.side is None or self._span_depth or self._inner_depth:
                return fn(*args, **kwargs)  # nested: the outer span owns the time
            kinds = kind_of(*args, **kwargs)
            outside, self._excluded = self._excluded, 0.0
            self._span_depth += 1
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                wall = self.clock() - start
                self._span_depth -= 1
                own, self._excluded = wall - self._excluded, outside
                self._spans_wall += wall
                total = sum(kinds.values())
                for kind, n in kinds.items():  # no action counted (n = 0): time shared evenly
                    self.count[self.side, kind] += n
                    share = n / total if total else 1 / len(kinds)
                    self.seconds[self.side, kind] += own * share
        return traced

    def inner(self, fn: Callable, blocking: Callable[..., bool] | None = None) -> Callable:
        """Time inside `fn` is not overhead (when `blocking(*args, **kwargs)`, if given)."""
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if self.side is None or self._inner_depth or (blocking and not blocking(*args,
                                                                                 **kwargs)):
                return fn(*args, **kwargs)
            self._inner_depth += 1
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._excluded += self.clock() - start
                self._inner_depth -= 1
        return traced

    def patch(self, owner, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Replace owner.name by wrap(owner.name); undone by `restore`."""
        had = name in vars(owner) if hasattr(owner, "__dict__") else True
        old = getattr(owner, name)
        setattr(owner, name, wrap(old))
        self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- steps ---------------------------------------------------------------------------------
    def step(self, side: str, fn: Callable[[], object]):
        """Run one training step of `side` under the tracer."""
        self.side, self._excluded, self._spans_wall = side, 0.0, 0.0
        start = self.clock()
        try:
            return fn()
        finally:
            wall = self.clock() - start
            self.count[side, STEP] += 1
            self.seconds[side, STEP] += wall - self._spans_wall - self._excluded
            self.side = None

    def per_action(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(side, kind) -> (actions counted, overhead seconds)."""
        return {key: (self.count[key], self.seconds[key]) for key in self.count}
