"""Why the planner chose what it chose: alternatives, the binding constraint, and plan diffs."""
from __future__ import annotations

from tabulate import tabulate

from planner.search.plan import Plan, gib, plural


def _mesh(p: Plan) -> str:
    v = f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""
    cp = f" cp={p.cp}" if p.cp > 1 else ""
    cp += f" ep={p.ep}" if p.ep > 1 else ""
    cp += f" zero={p.zero}" if p.zero else ""
    cp += f" dp_shard={p.dp_shard}" if p.dp_shard and p.dp_shard != p.dp else ""
    v += f" split_backward={p.split_backward}" if p.split_backward else ""
    v += f"  autocast {p.autocast}" if p.autocast else ""
    return (f"dp={p.dp} tp={p.tp} pp={p.pp}{cp}  {p.schedule}{v}  mb={p.micro_batch} "
            f"x{p.num_microbatches}")


def alternatives_table(plans: list[Plan]) -> str:
    best = plans[0].predicted.iteration_s
    rows = [[i + 1, _mesh(p), f"{p.predicted.iteration_s:.4g}",
             percent(best, p.predicted.iteration_s),
             gib(p.predicted.peak_memory_bytes), f"{p.predicted.bubble_fraction:.3f}",
             f"{p.predicted.tflops_per_gpu:.1f}"] for i, p in enumerate(plans)]
    return tabulate(rows, headers=["#", "configuration", "iteration s", "vs best",
                                   "peak GiB/device", "bubble", "TFLOP/s/GPU"],
                    disable_numparse=True)


def binding_constraint(plan: Plan) -> str:
    """What limits the winner: memory (over or near the cap), the pipeline bubble, or
    communication."""
    p = plan.predicted
    if p.peak_memory_bytes > plan.memory_limit_bytes:
        return (f"memory: it does not fit, needing {gib(p.peak_memory_bytes, up=True)} of "
                f"{gib(plan.memory_limit_bytes)} GiB per device")
    headroom = 1 - p.peak_memory_bytes / plan.memory_limit_bytes
    if headroom < 0.05:  # before compute: a compute-bound plan this full is held by memory too
        return (f"memory: the fullest device uses {gib(p.peak_memory_bytes)} of "
                f"{gib(plan.memory_limit_bytes)} GiB ({headroom:.1%} headroom); a faster "
                f"split of the same GPUs would not fit")
    if p.bubble_s + p.comm_s < 0.05 * p.iteration_s:
        return (f"compute: {p.compute_s / p.iteration_s:.1%} of the iteration is computation; "
                f"neither memory, bubble nor communication holds it back")
    if p.bubble_s >= p.comm_s:
        return (f"pipeline bubble: {p.bubble_s:.4g} s ({p.bubble_s / p.iteration_s:.1%} of the "
                f"iteration) of idle stages, "
                f"more than the {p.comm_s:.4g} s of exposed communication; more micro-batches "
                f"or fewer stages would shrink it but cost memory or communication")
    return (f"communication: {p.comm_s:.4g} s exposed per iteration "
            f"({p.comm_s / p.iteration_s:.1%}), more than the bubble of {p.bubble_s:.4g} s")


def next_best(plans: list[Plan]) -> str:
    if len(plans) < 2:
        return "no other configuration fits"
    a, b = plans[0].predicted, plans[1].predicted
    memory = a.peak_memory_bytes - b.peak_memory_bytes
    slower = b.iteration_s / a.iteration_s - 1
    speed = (f"is {slower:.1%} slower" if slower >= 5e-4 else
             "ties with the winner in time" + (f" ({slower:.2g} slower)" if slower else ""))
    held = (f"{'saves' if memory > 0 else 'needs'} {gib(abs(memory))} GiB per device "
            f"{'against' if memory > 0 else 'more than'} the winner"
            if gib(abs(memory)) != gib(0) else "needs the same memory per device")
    return (f"the next best ({_mesh(plans[1])}) {speed}; it {held}, with bubble "
            f"{b.bubble_fraction:.3f} vs {a.bubble_fraction:.3f} and exposed communication "
            f"{b.comm_s:.4g} s vs {a.comm_s:.4g} s")


def explain(plans: list[Plan]) -> str:
    return "\n".join([f"top {len(plans)} configurations:", alternatives_table(plans), "",
                      f"binding constraint of the winner: {binding_constraint(plans[0])}",
                      f"what the next best gives up: {next_best(plans)}"])


def diff(a: Plan, b: Plan, names: tuple[str, str] = ("a", "b")) -> str:
    """Side-by-side of what differs between two plans; each change is b's against a."""
    fields = [("model", a.model, b.model), ("gpus", a.gpus, b.gpus),
              ("cluster", a.cluster, b.cluster), ("configuration", _mesh(a), _mesh(b))]
    for key in ("iteration_s", "compute_s", "comm_s", "bubble_s", "bubble_fraction",
                "peak_memory_bytes", "tokens_per_s", "tflops_per_gpu"):
        fields.append((key, getattr(a.predicted, key), getattr(b.predicted, key)))
    for s in range(max(len(a.stages), len(b.stages))):
        fields.append((f"stage {s}", _stage(a, s), _stage(b, s)))
    rows = [[_label(k), _fmt(x, k), _fmt(y, k), _change(x, y)] for k, x, y in fields if x != y]
    if not rows:
        return "the plans are identical"
    return tabulate(rows, headers=["", *names, "change"], disable_numparse=True)


def _stage(plan: Plan, s: int) -> str:
    if s >= len(plan.stages):
        return "-"
    st = plan.stages[s]
    return f"{plural(len(st.layers), 'layer')}: {', '.join(sorted(set(st.strategies)))}"


def _label(key: str) -> str:
    return "peak_memory GiB" if key == "peak_memory_bytes" else key


def _fmt(x, key: str = "") -> str:
    if key == "peak_memory_bytes":
        return gib(x)
    if isinstance(x, float):
        return "0" if abs(x) < _NEGLIGIBLE else f"{x:.4g}"
    return str(x)


_NEGLIGIBLE = 1e-12  # seconds or fractions below this are rounding left by a subtraction


def percent(x: float, y: float) -> str:
    """y against the baseline x, '+3.9%': rounded first, so a change that rounds to nothing is
    '0.0%' (never '-0.0%', nor '+0.0%' beside a '-0.0%' of the same two numbers)."""
    change = round((y / x - 1) * 100, 1)
    return "0.0%" if change == 0 else f"{change:+.1f}%"


def _change(x, y) -> str:
    if not (isinstance(x, (int, float)) and isinstance(y, (int, float))):
        return ""
    if abs(x) < _NEGLIGIBLE:
        return "from 0" if abs(y) >= _NEGLIGIBLE else ""
    return percent(x, y)
