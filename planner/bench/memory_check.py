"""`fxpar plan --check`: the plan's rank programs dry-run on fake tensors (runtime.observe.
dry_run), each rank's peak beside the plan's prediction, and a line wherever the two disagree.

Ranks that differ only in their tensor-, context- or data-parallel index hold shards of equal
shapes (every split is even, padded where it must be), so by default one rank per pipeline rank
is dry-run for plans over 16 GPUs and its figure stands for the ranks of that pipeline rank;
`every_rank` runs them all.
"""
from __future__ import annotations

from tabulate import tabulate

from planner.search.plan import MEMORY_PARTS, Plan, gib

GiB = 2**30
DISAGREE = 0.10     # a relative difference the plan reports


def ranks_to_check(plan: Plan, every_rank: bool | None = None) -> list[int]:
    """Every rank, or the first rank of each pipeline rank (the default over 16 GPUs)."""
    if every_rank or (every_rank is None and plan.gpus <= 16):
        return list(range(plan.gpus))
    per_stage = plan.gpus // plan.pp
    return [p * per_stage for p in range(plan.pp)]


def runtime_options(plan: Plan) -> dict:
    """The options fxpar's runtime trains this plan with by default: bf16 weights with fp32
    main weights on GPUs (runtime.training.main_weights), fp32 on CPU ranks."""
    return {"precision": "fp32" if plan.cluster.startswith("cpu") else "bf16-main"}


def check(plan: Plan, spec, every_rank: bool | None = None, options: dict | None = None,
          workers: int = 0):
    """{rank: RankMemory} of the dry run of the ranks `ranks_to_check` picks, `workers` at a
    time (0: one per CPU core)."""
    from planner.bench.dry_run import dry_run
    ranks = ranks_to_check(plan, every_rank)
    runs = dry_run(spec, plan, options if options is not None else runtime_options(plan), ranks,
                   workers=workers)
    return dict(zip(ranks, runs))


def check_table(plan: Plan, dry: dict) -> str:
    """Per dry-run rank: predicted and dry-run GiB of each part, and dry / predicted; then a
    line per rank where they disagree by more than DISAGREE."""
    per_stage = plan.gpus // plan.pp
    rows, notes = [], []
    unit, scale = ("GiB", GiB) if max(r.peak_bytes for r in dry.values()) >= GiB else \
        ("MiB", 2**20)
    for rank, run in dry.items():
        predicted = dict(zip(MEMORY_PARTS, plan.predicted.rank_memory[rank // per_stage]))
        total = sum(predicted.values())
        stands = (f"{rank}-{rank + per_stage - 1}" if len(dry) < plan.gpus and per_stage > 1
                  else str(rank))
        rows.append([stands, *(f"{predicted[k] / scale:.3g} / {run.split[k] / scale:.3g}"
                               for k in MEMORY_PARTS),
                     f"{total / scale:.3g} / {run.peak_bytes / scale:.3g}",
                     f"{run.peak_bytes / total:.3f}" if total else "-"])
        if total and abs(run.peak_bytes / total - 1) > DISAGREE:
            notes.append(f"rank {rank}: its programs peak at {run.peak_bytes / scale:.3g} "
                         f"{unit}, the plan predicts {total / scale:.3g} {unit} "
                         f"({run.peak_bytes / total - 1:+.1%}): the dry run is what these "
                         f"programs allocate")
    table = tabulate(rows, headers=["rank", *MEMORY_PARTS, "total", "dry/pred"],
                     disable_numparse=True)
    head = (f"dry run of the rank programs on fake tensors, {unit} predicted / dry run, live "
            f"tensors\n(before the allocator's reserve and the device's own terms)")
    if len(dry) < plan.gpus:
        head += (f"; one rank per pipeline rank: the ranks it stands for hold shards of the "
                 f"same shapes")
    head += ":"
    agree = (f"predicted and dry-run peaks agree within {DISAGREE:.0%} on every rank checked"
             if not notes else "\n".join(notes))
    return "\n".join(filter(None, (head, table, agree, over_limit(plan, dry))))


def over_limit(plan: Plan, dry: dict) -> str:
    """A line when a dry-run peak, with what the device holds beyond live tensors, passes the
    plan's memory limit (whatever the prediction said), and what to do: plan with the limit
    less the prediction's shortfall on that rank, where that leaves a usable limit."""
    device = plan.predicted.device_bytes
    rank, run = max(dry.items(), key=lambda item: item[1].peak_bytes)
    needed = run.peak_bytes + device
    if needed <= plan.memory_limit_bytes:
        return ""
    over = needed - plan.memory_limit_bytes
    per_stage = plan.gpus // plan.pp
    short = run.peak_bytes - sum(plan.predicted.rank_memory[rank // per_stage])
    line = (f"rank {rank}: its programs peak at {run.peak_bytes / GiB:.3g} GiB of live "
            f"tensors, {needed / GiB:.4g} GiB with the device's own {device / GiB:.3g} GiB, "
            f"over the {plan.memory_limit_bytes / GiB:.4g} GiB limit by {over / GiB:.3g} GiB: "
            f"this plan would not fit; ")
    limit = plan.memory_limit_bytes - short
    if short > 0 and limit >= plan.memory_limit_bytes / 2:
        return line + (f"plan with --memory-limit {gib(limit)} (the limit less the "
                       f"{short / GiB:.3g} GiB the prediction misses here) for one that does")
    return line + ("choose another layout (--fix) and check it again: the prediction misses "
                   f"this one by {max(short, 0) / GiB:.3g} GiB, too much for a lower limit to "
                   "make up")
