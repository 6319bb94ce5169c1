"""Pipeline-schedule IR: actions, per-rank action lists and their text form.

A schedule says, for every rank, which actions it runs and in what order.
Stages are placed round-robin ("looping" placement): stage ``s`` lives on
rank ``s % num_ranks``, so with ``v`` stages per rank a rank holds stages
``r, r + p, r + 2p, ...``.

Execution model, shared by the validator, the simulator and the executor:

* ``SEND_*`` and ``RECV_*`` are non-blocking posts (isend / irecv).
* ``F(s, k)`` with ``s > 0`` waits for its ``RECV_F(s, k)`` when stage
  ``s - 1`` lives on another rank; ``B/I(s, k)`` with ``s < last`` waits for
  its ``RECV_B(s, k)`` when stage ``s + 1`` lives on another rank.
* A receive completes once the peer has posted the matching send.
* Neighbouring stages on the same rank hand data over in memory, with no
  communication actions.

Generators live in :mod:`runtime.pipeline.generators`, the checker in
:mod:`runtime.pipeline.validate` and the text grid (a unit-time simulation) in
:mod:`runtime.pipeline.simulator`; they import this module, never the reverse.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule that cannot run correctly; the message names rank and action."""


class Kind(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward: input and weight gradients together
    I = "I"  # noqa: E741  backward, input gradient only
    W = "W"  # backward, weight gradient only
    SEND_F = "SEND_F"  # send stage s's output activation to stage s + 1
    RECV_F = "RECV_F"  # receive stage s's input activation from stage s - 1
    SEND_B = "SEND_B"  # send stage s's input gradient to stage s - 1
    RECV_B = "RECV_B"  # receive stage s's output gradient from stage s + 1

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in _SEND_KINDS


_COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
_SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})


# Longest alternatives first so "SEND_F" is never read as stage + "S...".
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: Kind
    mb: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))  # accept "F" too
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and micro-batch must be >= 0 in {self}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"bad action {text!r}: expected <stage><kind><micro-batch>, "
                "e.g. '2F0', '1B3', '0W1', '3SEND_F2', '1RECV_B0'"
            )
        return Action(int(match[1]), Kind(match[2]), int(match[3]))

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute


# comm kind -> (stage offset of the peer's action, the peer's kind)
_PAIRS = {
    Kind.SEND_F: (+1, Kind.RECV_F),
    Kind.RECV_F: (-1, Kind.SEND_F),
    Kind.SEND_B: (-1, Kind.RECV_B),
    Kind.RECV_B: (+1, Kind.SEND_B),
}

_HEADER_RE = re.compile(
    r"schedule\s+(\S+):\s+ranks=(\d+)\s+stages=(\d+)\s+microbatches=(\d+)"
)
_RANK_RE = re.compile(r"rank\s+(\d+):(.*)")


@dataclass(frozen=True)
class Schedule:
    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order

    def __post_init__(self) -> None:
        # Accept lists from hand-written schedules; keep the object hashable.
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.num_ranks < 1 or self.num_microbatches < 1:
            raise ValueError("a schedule needs at least one rank and one micro-batch")
        if self.num_stages < self.num_ranks or self.num_stages % self.num_ranks:
            raise ValueError(
                f"num_stages={self.num_stages} must be a positive multiple "
                f"of num_ranks={self.num_ranks}"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"{len(self.actions)} action lists for {self.num_ranks} ranks"
            )

    # -- placement -------------------------------------------------------
    def stage_to_rank(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.num_ranks - 1}")
        return tuple(range(rank, self.num_stages, self.num_ranks))

    # -- communication pairing ---------------------------------------------
    def counterpart(self, action: Action) -> Action | None:
        """The action on the peer rank that matches a SEND/RECV, or None when
        the stage has no neighbour on another rank in that direction."""
        if action.kind not in _PAIRS:
            return None
        step, kind = _PAIRS[action.kind]
        stage = action.stage + step
        if not 0 <= stage < self.num_stages:
            return None
        if stage % self.num_ranks == action.stage % self.num_ranks:
            return None  # same rank: data moves in memory
        return Action(stage, kind, action.mb)

    def peer(self, action: Action) -> int | None:
        """Rank on the other end of a SEND/RECV (None if it has no peer)."""
        match = self.counterpart(action)
        return None if match is None else self.stage_to_rank(match.stage)

    def recv_for(self, action: Action) -> Action | None:
        """The receive a compute action waits on, or None if it waits on none."""
        return self._transfer(action, Kind.RECV_F, Kind.RECV_B)

    def send_after(self, action: Action) -> Action | None:
        """The send that ships a compute action's result to another rank."""
        return self._transfer(action, Kind.SEND_F, Kind.SEND_B)

    def _transfer(self, action: Action, forward: Kind, backward: Kind) -> Action | None:
        """The transfer of kind `forward` (for an F) or `backward` (for a B or an I) of the
        compute action's stage and micro-batch, where it has a peer; else None."""
        if action.kind is Kind.F:
            kind = forward
        elif action.kind in (Kind.B, Kind.I):
            kind = backward
        else:
            return None
        transfer = Action(action.stage, kind, action.mb)
        return transfer if self.counterpart(transfer) is not None else None

    # -- text forms --------------------------------------------------------
    def __str__(self) -> str:
        header = (
            f"schedule {self.name}: ranks={self.num_ranks} "
            f"stages={self.num_stages} microbatches={self.num_microbatches}"
        )
        rows = [
            f"rank {r}: " + " ".join(str(a) for a in acts)
            for r, acts in enumerate(self.actions)
        ]
        return "\n".join([header, *rows])

    @staticmethod
    def parse(text: str) -> Schedule:
        """Inverse of ``str(schedule)``. The header line is optional; without
        it ranks, stages and micro-batches are inferred from the actions."""
        header, rows = None, {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if (m := _HEADER_RE.fullmatch(line)) is not None:
                header = (m[1], int(m[2]), int(m[3]), int(m[4]))
            elif (m := _RANK_RE.fullmatch(line)) is not None:
                rank = int(m[1])
                if rank in rows:
                    raise ValueError(f"line {lineno}: rank {rank} listed twice")
                try:
                    rows[rank] = tuple(Action.parse(t) for t in m[2].split())
                except ValueError as err:
                    raise ValueError(f"line {lineno}: {err}") from None
            else:
                raise ValueError(
                    f"line {lineno}: expected 'rank <r>: <actions>' or "
                    f"'schedule <name>: ranks=.. stages=.. microbatches=..', got {raw!r}"
                )
        if sorted(rows) != list(range(len(rows))) or not rows:
            raise ValueError(f"ranks must be listed as 0..n-1, got {sorted(rows)}")
        actions = tuple(rows[r] for r in range(len(rows)))
        if header is None:
            flat = [a for acts in actions for a in acts]
            header = (
                "custom",
                len(rows),
                max((a.stage for a in flat), default=len(rows) - 1) + 1,
                max((a.mb for a in flat), default=0) + 1,
            )
        name, ranks, stages, mbs = header
        return Schedule(name, ranks, stages, mbs, actions)
