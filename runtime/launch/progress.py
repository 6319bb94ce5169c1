"""Progress of long work (training steps, benchmark runs, calibration rounds) on stderr.

On a terminal a bar is redrawn in place:

    [########............] 4/10 steps  52,113 tokens/s  loss 5.4721  6.2 s left  dp=2 tp=2 pp=2

elsewhere (a log file, CI, a pipe) each update is one plain line:

    step 4/10: 52,113 tokens/s, loss 5.4721, 6.2 s left (dp=2 tp=2 pp=2)

Time left is the mean time per step so far times the steps left (the first update counts from
when the bar was made). Nothing here imports the planner; fxpar run, bench and calibrate use it.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO


def format_seconds(seconds: float) -> str:
    """'12.3 s', '4 min 05 s', '1 h 02 min'."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress:
    """`total` units of work named `unit` (plural with an s). `update` reports the units done so
    far (or `advance` more) with what is known: a rate (`rate_unit` per second: tokens, or
    samples of a model whose inputs are not sequences), the loss, a label. A bar on a
    terminal (`tty`, by default whether `stream` is one), plain lines otherwise; `enabled=False`
    prints nothing."""

    def __init__(self, total: int, unit: str = "step", stream: TextIO | None = None,
                 tty: bool | None = None, enabled: bool = True, width: int = 20,
                 clock: Callable[[], float] = time.monotonic, rate_unit: str = "tokens"):
        self.total, self.unit, self.width, self.enabled = max(int(total), 0), unit, width, enabled
        self.rate_unit = rate_unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and (self.stream.isatty() if tty is None else tty)
        self.clock, self.start, self.done = clock, clock(), 0
        self._drawn = 0          # width of the bar line on screen (a terminal)

    def update(self, done: int | None = None, *, advance: int = 1, per_s: float | None = None,
               loss: float | None = None, label: str = "") -> str:
        """Record progress and show it; returns the text shown (without the redraw codes)."""
        self.done = min(self.total, self.done + advance if done is None else done)
        line = self.line(per_s, loss, label)
        if self.enabled:
            if self.tty:
                self.stream.write("\r" + line.ljust(self._drawn))
                self._drawn = len(line)
                if self.done >= self.total:
                    self.stream.write("\n")
                    self._drawn = 0
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        return line

    def seconds_left(self) -> float:
        if self.done <= 0:
            return math.nan
        return (self.clock() - self.start) / self.done * (self.total - self.done)

    def line(self, per_s: float | None = None, loss: float | None = None,
             label: str = "") -> str:
        facts = []
        if per_s is not None:
            facts.append(f"{per_s:,.0f} {self.rate_unit}/s")
        if loss is not None:
            facts.append(f"loss {loss:.4f}")
        if self.done < self.total and self.done > 0:
            facts.append(f"{format_seconds(self.seconds_left())} left")
        elif self.done >= self.total:
            facts.append(f"done in {format_seconds(self.clock() - self.start)}")
        count = f"{self.done}/{self.total}"
        if self.tty:
            filled = self.width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            return "  ".join([f"[{bar}] {count} {self.unit}s", *facts] + ([label] if label else []))
        text = f"{self.unit} {count}" + (": " + ", ".join(facts) if facts else "")
        return text + (f" ({label})" if label else "")

    def close(self) -> None:
        """End a bar left short of its total (an error, Ctrl-C) on its own line."""
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
