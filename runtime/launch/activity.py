"""What this process is doing right now, in a few words: "step 2, action 1F3 (recv from rank 0)",
"step 1, data-parallel all-reduce of stage 0", "step 3, optimizer step".

The runtime sets it at the points that matter (each pipeline action, each collective, the
optimizer step) and error reports quote it. A rank started by runtime.launch.ranks also mirrors it into
a small block of memory shared with the launcher, so the launcher can say where a rank was even
when it was killed outright and could report nothing itself. Setting it costs about a
microsecond: a string and, under the launcher, a copy of at most SLOT_BYTES bytes.
"""
from __future__ import annotations

import weakref

SLOT_BYTES = 160

_step: int | None = None
_doing = ""
_slot = None  # a ctypes char array shared with the launcher, or None
_steps_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_listeners: list = []  # called with each new <what> (runtime.observe.step_timing times the phases)


def current() -> str:
    """"step N, <what>" inside a training step, else just <what> (may be "")."""
    if _step is None:
        return _doing
    return f"step {_step}, {_doing}" if _doing else f"step {_step}"


def now(doing: str) -> None:
    """This process is now doing `doing` (within the current step, if any)."""
    global _doing
    _doing = doing
    _publish()
    for listener in _listeners:
        listener(doing)


def detail(text: str) -> None:
    """Add a detail to what is being done: "action 1F3" becomes "action 1F3 (recv from rank 0)"."""
    now(f"{_doing} ({text})")


def start_step(owner) -> int:
    """A training step of `owner` (a trainer) starts; steps are counted per owner, from 1."""
    global _step, _doing
    _step = _steps_of.get(owner, 0) + 1
    _steps_of[owner] = _step
    _doing = "start"
    _publish()
    for listener in _listeners:
        listener(_doing)
    return _step


def listen(listener) -> None:
    """Call `listener(doing)` whenever what this process does changes; `unlisten` stops it."""
    _listeners.append(listener)


def unlisten(listener) -> None:
    _listeners.remove(listener)


def step() -> int | None:
    """The number of the training step under way, or None outside one."""
    return _step


def reset(doing: str = "") -> None:
    """Forget the step: a new job starts."""
    global _step, _doing
    _step, _doing = None, doing
    _publish()


def share(slot) -> None:
    """Mirror every change into `slot` (a ctypes char array of SLOT_BYTES, shared memory)."""
    global _slot
    _slot = slot
    _publish()


def read(slot) -> str:
    """What a shared slot last said (read by the launcher, possibly after the writer died)."""
    return bytes(slot[:]).split(b"\0", 1)[0].decode("utf-8", "replace")


def _publish() -> None:
    if _slot is not None:
        data = current().encode("utf-8", "replace")[: SLOT_BYTES - 1]
        _slot[: len(data) + 1] = data + b"\0"
