"""One whole training step of a pipeline, simulated on cores the ranks may share.

runtime.pipeline.simulator lays a schedule out with each rank on a device of its own. A step has more
than its schedule, and on CPU several ranks may share a core; this simulates both. Each pipeline
rank runs, in order:

  step sync           waiting (no CPU) for the step's opening check across ranks
  set-up              CPU: splitting the batch, zeroing gradients (the runtime's own per step)
  its actions         a compute action costs the runtime's per-action overhead, then, if it needs
                      a message, waits until the message has arrived (p2p seconds after the send
                      was posted), then its compute; a send is on its way once posted and
                      then costs the sender CPU (send_overhead); a received message costs
                      the receiver CPU once it is there (recv_overhead: posting the receive,
                      taking the message, gloo's own thread moving it).
                      A post made while more ranks want CPU than run unshared on the cores
                      also waits for the core the woken receiver took (send_wait), and its
                      message takes shared_p2p_s
  dp sync             the exposed part of the data-parallel collectives, as CPU: a CPU rank's
                      collective reduces and copies on its own cores (gloo), so ranks sharing
                      cores slow it as they slow compute; with a device per rank, no change
  optimizer           CPU: the optimizer step over the rank's parameters

and the step ends `finish_s` (the loss handed from the last stage to every rank) after the last
rank is done.

Shared cores are processor sharing, as an OS scheduler time-slices: while k ranks use CPU on C
cores, each runs at min(1, C / k) of its own speed — unless k is at most `unshared` (busy ranks
measured not to slow each other down), when each runs at full speed. A pipeline rank stands for `replicas` ranks
(its dp × tp × cp copies, which run the same timeline), so k counts all of them. With
cores = inf and no overheads the schedule part equals runtime.pipeline.simulator.simulate.

The step's parts per rank use runtime.observe.step_timing's names, so a prediction and a measurement
line up part by part: F<s> B<s> I<s> W<s> (compute of stage s), "p2p wait", "dp sync",
"step sync", "optimizer", "overhead", and "idle" (waiting for the last rank at the end).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.pipeline.schedule import Action, Schedule
from runtime.pipeline.simulator import Event, Timeline
from runtime.pipeline.validate import validate


@dataclass(frozen=True)
class StepCosts:
    """Seconds at a rank's own speed; per-rank terms are one value or one per pipeline rank."""
    duration: Callable[[Action], float]   # compute of one action
    p2p_s: float = 0.0                    # from a send's post to its arrival
    action_overhead_s: float = 0.0        # CPU per compute action, outside the action
    setup_s: float = 0.0                  # CPU per step before the schedule
    sync_s: float | Sequence[float] = 0.0       # exposed data-parallel sync, waiting
    optimizer_s: float | Sequence[float] = 0.0  # CPU
    replicas: int = 1                     # ranks each pipeline rank stands for
    cores: float = math.inf               # cores the ranks share
    unshared: float = 0.0                 # busy ranks that still run at full speed
    send_overhead_s: float = 0.0          # CPU of the sender per message posted
    start_s: float = 0.0                  # waiting at the start (the step's check across ranks)
    finish_s: float = 0.0                 # after the last rank: the loss reaching every rank
    # A post while more ranks want CPU than run unshared on the cores: the sender then waits
    # (no CPU) for the core the receiver it wakes took, and the message takes shared_p2p_s
    # (both measured with every core busy); 0: as on idle cores
    send_wait_s: float = 0.0
    shared_p2p_s: float = 0.0
    recv_overhead_s: float = 0.0          # CPU of the receiver per message, once it arrived


@dataclass(frozen=True)
class StepTimeline:
    timeline: Timeline                    # compute actions, wall-clock start and end
    parts: tuple[dict[str, float], ...]   # per pipeline rank: seconds per part
    makespan: float


@dataclass
class _Task:
    part: str                 # the part its time goes to
    cpu: float = 0.0          # CPU seconds left (CPU tasks)
    wait: float = 0.0         # seconds to wait (sync)
    recv: Action | None = None    # a message to wait for
    send: Action | None = None    # a send to post
    action: Action | None = None  # the compute action, for the timeline
    started: float | None = None
    until: float | None = None    # when a wait ends, once known


@dataclass
class _Rank:
    tasks: list[_Task]
    next: int = 0
    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    end: float = 0.0

    @property
    def task(self) -> _Task | None:
        return self.tasks[self.next] if self.next < len(self.tasks) else None


def _per_rank(value, ranks: int) -> list[float]:
    return [float(value)] * ranks if isinstance(value, (int, float)) else [float(v) for v in value]


def _tasks(schedule: Schedule, rank: int, costs: StepCosts, sync: float, opt: float):
    tasks = [_Task("step sync", wait=costs.start_s), _Task("overhead", cpu=costs.setup_s)]
    for action in schedule.actions[rank]:
        if action.kind.is_send:
            tasks.append(_Task("overhead", send=action))
            tasks.append(_Task("overhead", cpu=costs.send_overhead_s))
        elif action.is_compute:
            tasks.append(_Task("overhead", cpu=costs.action_overhead_s))
            if (recv := schedule.recv_for(action)) is not None:
                tasks.append(_Task("p2p wait", recv=schedule.counterpart(recv)))
                tasks.append(_Task("overhead", cpu=costs.recv_overhead_s))
            tasks.append(_Task(f"{action.kind.value}{action.stage}", cpu=costs.duration(action),
                               action=action))
    return tasks + [_Task("dp sync", cpu=sync), _Task("optimizer", cpu=opt)]


def simulate_step(schedule: Schedule, costs: StepCosts) -> StepTimeline:
    """Simulate one step of `schedule` (see the module docstring)."""
    validate(schedule)
    p = schedule.num_ranks
    syncs, opts = _per_rank(costs.sync_s, p), _per_rank(costs.optimizer_s, p)
    ranks = [_Rank(_tasks(schedule, r, costs, syncs[r], opts[r])) for r in range(p)]
    arrive: dict[Action, float] = {}  # when each posted message arrives
    events: list[Event] = []
    now = 0.0
    while True:
        _start_ready(ranks, arrive, costs, now, events)
        running = [r for r in ranks if r.task is not None]
        if not running:
            break
        busy = [r for r in running if r.task.cpu > 0]
        rate = _rate(len(busy) * costs.replicas, costs)
        ends = [now + r.task.cpu / rate for r in busy]
        ends += [r.task.until for r in running if r.task.until is not None]
        if not ends:
            raise RuntimeError("simulate_step: every rank waits for a message never sent")
        later = min(ends)
        for r in busy:
            r.task.cpu = max(0.0, r.task.cpu - rate * (later - now))
            if r.task.cpu <= 1e-15 * max(1.0, later):
                r.task.cpu = 0.0
        now = later
    now += costs.finish_s
    for r in ranks:
        r.parts["idle"] += now - r.end
    events.sort(key=lambda e: (e.rank, e.start))
    return StepTimeline(Timeline(tuple(events), now), tuple(dict(r.parts) for r in ranks), now)


def _rate(busy: int, costs: StepCosts) -> float:
    """Each busy rank's share of its own speed."""
    if busy <= costs.unshared or busy == 0:
        return 1.0
    return min(1.0, costs.cores / busy)


def _whole(cores: float) -> float:
    """Cores as whole cores: ranks slowed down by sharing a cache (two ranks on two cores at
    1.8 cores' speed) still each have a core to be woken on."""
    return cores if math.isinf(cores) else max(1, round(cores))


def _start_ready(ranks: list[_Rank], arrive, costs: StepCosts, now: float, events) -> None:
    """Finish what is done at `now` and start what can start, until nothing changes (a send
    posted by one rank may let another rank's wait begin)."""
    busy = {i for i, r in enumerate(ranks) if r.task is not None and r.task.cpu > 0}

    def crowded(index: int) -> bool:
        """Whether a post by rank `index` now finds more ranks wanting CPU (itself, posting,
        and the others computing) than run unshared on the cores."""
        wanting = (len(busy - {index}) + 1) * costs.replicas
        return wanting > costs.unshared and wanting > _whole(costs.cores)

    changed = True
    while changed:
        changed = False
        for index, r in enumerate(ranks):
            while (task := r.task) is not None and _step(index, r, task, arrive, costs, crowded,
                                                        now, events):
                changed = True


def _step(index: int, r: _Rank, task: _Task, arrive, costs: StepCosts, crowded, now: float,
          events) -> bool:
    """Advance rank r's current task at time `now`; True when it finished (the next may go)."""
    if task.started is None:
        task.started = now
        if task.send is not None:
            shared = crowded(index)
            hop = costs.shared_p2p_s if shared and costs.shared_p2p_s else costs.p2p_s
            arrive[task.send] = now + hop
            task.until = now + (costs.send_wait_s if shared else 0.0)
        elif task.wait:
            task.until = now + task.wait
    if task.recv is not None and task.until is None:
        if task.recv not in arrive:
            return False  # its send is not posted yet
        task.until = max(now, arrive[task.recv])
    if task.cpu > 0 or (task.until is not None and task.until > now):
        return False
    if task.part:
        r.parts[task.part] += now - task.started
    if task.action is not None:
        events.append(Event(index, task.action, task.started, now))
    r.next += 1
    r.end = now
    return True
