"""Pictures of a plan: its predicted pipeline timeline, and its layers and memory per stage."""
from __future__ import annotations

import os

from planner.search.plan import GiB, Plan
from runtime.pipeline.generators import make_schedule
from runtime.pipeline.simulator import Timeline, simulate
from runtime.pipeline.timeline import plot_gantt, to_chrome_trace

_COLORS = {"none": "#9e9e9e", "tp": "#1f77b4", "tp+sp": "#2ca02c", "vocab-tp": "#17becf"}


def predicted_timeline(plan: Plan) -> Timeline:
    """Simulate the plan's schedule with each stage's predicted forward and backward times
    (backward twice the forward, the usual ratio; split backward: I and W equal)."""
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    times = [st.time_s for st in plan.stages]

    def duration(action) -> float:
        t = times[action.stage]
        return {"F": t / 3, "B": 2 * t / 3, "I": t / 3, "W": t / 3}[action.kind.value]

    return simulate(schedule, duration)


def write_timeline(plan: Plan, out_dir: str, measured: Timeline | None = None) -> list[str]:
    """PNG Gantt chart and Chrome trace (opens in Perfetto) of the predicted timeline."""
    os.makedirs(out_dir, exist_ok=True)
    timelines = {"predicted": predicted_timeline(plan)}
    if measured is not None:
        timelines["measured"] = measured
    png, trace = os.path.join(out_dir, "timeline.png"), os.path.join(out_dir, "timeline.json")
    plot_gantt(timelines, png)
    to_chrome_trace(timelines, trace)
    return [png, trace]


def plot_plan(plan: Plan, path: str) -> str:
    """Stages × layers coloured by strategy, beside memory per device against the limit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = plan.stages
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.45 * len(stages)),
                                      gridspec_kw={"width_ratios": [3, 1]})
    for s, st in enumerate(stages):
        for i, strategy in enumerate(st.strategies):
            color = _COLORS.get(strategy, "#d62728" if "full" in strategy else "#ff7f0e")
            left.barh(s, 1, left=sum(len(x.layers) for x in stages[:s]) + i, color=color,
                      edgecolor="white")
    left.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))])
    left.invert_yaxis()
    left.set_xlabel("layer (embed, blocks, head)")
    cp = f" cp={plan.cp}" if plan.cp > 1 else ""
    left.set_title(f"{plan.model} on {plan.gpus} GPUs: dp={plan.dp} tp={plan.tp} pp={plan.pp}"
                   f"{cp}, {plan.schedule}")
    used = sorted({s for st in stages for s in st.strategies})
    left.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_COLORS.get(u, "#ff7f0e"))
                         for u in used], labels=used, loc="upper right", fontsize=8)
    parts = [("params+grads", "weight_grad_bytes", "#1f77b4"), ("optimizer", "optimizer_bytes",
             "#aec7e8"), ("activations", "activation_bytes", "#ff7f0e"),
             ("other", "transient_bytes", "#ffbb78")]
    base = [0.0] * len(stages)
    for label, field, color in parts:
        values = [getattr(st, field) / GiB for st in stages]
        right.barh(range(len(stages)), values, left=base, color=color, label=label)
        base = [b + v for b, v in zip(base, values)]
    right.axvline(plan.memory_limit_bytes / GiB, color="black", linestyle="--", label="limit")
    right.set_yticks(range(len(stages)), [""] * len(stages))
    right.invert_yaxis()
    right.set_xlabel("GiB per device")
    # In a strip of its own under the panels: the bars fill the panel's height, and the limit
    # line its right side.
    fig.legend(*right.get_legend_handles_labels(), fontsize=7, loc="lower right", ncol=5)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
