"""Timeline export: Chrome-trace JSON (opens in Perfetto / chrome://tracing)
and a PNG Gantt chart, for comparing e.g. predicted and measured runs."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from runtime.pipeline.simulator import Timeline

# Colour per action kind; communication events (if any) fall back to grey.
_COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b3"}


def to_chrome_trace(timelines: Mapping[str, Timeline], path: str | os.PathLike) -> None:
    """Write one process per timeline label and one thread per rank; each
    event is named by its action text (e.g. "1F3") and timed in microseconds
    from the start of its timeline."""
    trace: list[dict] = []
    for pid, (label, timeline) in enumerate(timelines.items()):
        origin = min((e.start for e in timeline.events), default=0.0)
        trace.append(_meta("process_name", pid, 0, label))
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for rank in sorted({e.rank for e in timeline.events}):
            trace.append(_meta("thread_name", pid, rank, f"rank {rank}"))
        for e in timeline.events:
            trace.append(
                {
                    "name": str(e.action),
                    "cat": e.action.kind.value,
                    "ph": "X",
                    "pid": pid,
                    "tid": e.rank,
                    "ts": (e.start - origin) * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "args": {"stage": e.action.stage, "microbatch": e.action.mb},
                }
            )
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def _meta(name: str, pid: int, tid: int, value: str) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}


def plot_gantt(timelines: Mapping[str, Timeline], path: str | os.PathLike) -> None:
    """Write a PNG with one Gantt subplot per label, side by side: ranks on
    the y axis (rank 0 on top), time on x, boxes coloured by F/B/I/W and
    labelled with their micro-batch."""
    import matplotlib  # optional dependency, only needed for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timelines:
        raise ValueError("plot_gantt needs at least one timeline")
    fig, axes = plt.subplots(
        1, len(timelines), figsize=(7 * len(timelines), 1.2 + 0.5 * _max_ranks(timelines)), squeeze=False
    )
    for ax, (label, timeline) in zip(axes[0], timelines.items()):
        _draw(ax, label, timeline)
    handles = [Patch(color=c, label=k) for k, c in _COLOURS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _max_ranks(timelines: Mapping[str, Timeline]) -> int:
    return max(max(t.num_ranks, 1) for t in timelines.values())


def _draw(ax, label: str, timeline: Timeline) -> None:
    origin = min((e.start for e in timeline.events), default=0.0)
    span = timeline.makespan or 1.0
    # With several stages per rank, fade every other local stage to tell them apart.
    local: dict[int, list[int]] = {}
    for e in sorted(timeline.events, key=lambda e: e.action.stage):
        if e.action.stage not in local.setdefault(e.rank, []):
            local[e.rank].append(e.action.stage)
    for e in timeline.events:
        start, width = e.start - origin, e.end - e.start
        colour = _COLOURS.get(e.action.kind.value, "#999999")
        alpha = 0.5 if local[e.rank].index(e.action.stage) % 2 else 1.0
        ax.barh(e.rank, width, left=start, height=0.8, color=colour, alpha=alpha,
                edgecolor="black", linewidth=0.3)
        if width > span / 200:  # skip labels that would not fit
            ax.text(start + width / 2, e.rank, str(e.action.mb), ha="center", va="center", fontsize=6)
    ranks = max(timeline.num_ranks, 1)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, as in schedule diagrams
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s)")
    ax.set_title(label)
