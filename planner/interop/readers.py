"""What a configuration read from another framework says (planner.interop.from_megatron,
planner.interop.from_torchtitan), and the checks both readers share."""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.interop.configuration import Configuration


@dataclass
class Imported:
    """A configuration read from another framework and what it says about the run."""
    source: str                                  # "Megatron-LM" or "torchtitan"
    config: Configuration
    seq: int | None = None                       # the run's sequence length, if it sets one
    global_batch: int | None = None
    zero1: bool = False
    notes: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    recompute: str = "none"                      # how the source states it, for the summary
    runtime: str | None = None                   # the runtime profile it runs (compiled: its own)


def positive(flag: str, value, what: str = "a positive integer") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            not str(value).strip().isdigit() or int(value) < 1:
        raise ValueError(f"{flag}: expected {what}, got {value!r}")
    return int(value)


def sized(flag: str, given: int | None, ours: int | None, ours_flag: str) -> int | None:
    if given is not None and ours is not None and given != ours:
        raise ValueError(f"{flag} {given} contradicts {ours_flag} {ours}")
    return given if given is not None else ours
