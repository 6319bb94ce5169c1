"""Per-rank memory of a plan's real rank programs, measured, beside the plan's prediction.

`measure_worker` runs on every rank (a RankPool's, or torchrun's): it builds the model on the meta
device, lets ParallelModel materialise this rank's shard under a runtime.observe.memory_tracker
MemoryTracker, trains a few steps with AdamW (the optimizer the planner prices: two fp32 moments)
and returns the peak of live tensor bytes split into parameters, gradients, optimizer states,
activations and the rest. The peak counted is the training steps' (after the shard is built:
set-up is planner.bench.setup_memory's subject). `predicted_split` is the plan's prediction split
the same way, per rank, so the two can be set side by side (`memory_table`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tabulate import tabulate

from planner.search.plan import MEMORY_PARTS, Plan
from runtime.observe.memory_tracker import CATEGORIES, MemoryTracker

MiB = 2**20
STATIC = ("parameters", "gradients", "optimizer")


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak of live tensor bytes, by category (runtime.observe.memory_tracker)."""
    rank: int
    peak_bytes: int
    split: dict
    routing: tuple = ()   # what its mixture-of-experts layers routed (runtime.experts.routing_log)

    @property
    def static_bytes(self) -> int:
        return sum(self.split[k] for k in STATIC)


def mark_state(tracker: MemoryTracker, trainer) -> None:
    """Tell the tracker what the trainer's tensors hold: its stages' parameters and buffers,
    their gradients (flat buckets included), the optimizer's state. Under ZeRO-3 a unit's
    whole buffer, gathered for a moment, is "other" and the shard is the parameters."""
    sharded = trainer.sharded
    if sharded is not None and sharded.level == 3:
        tracker.mark([b.full for b in sharded.buckets], "other")
    params = [p for prog in trainer.programs.values() for p in prog.gm.parameters()]
    buffers = [b for prog in trainer.programs.values() for b in prog.gm.buffers()]
    if sharded is not None:
        params = list(sharded.optimizer_params()) + params
    tracker.mark(params + buffers, "parameters")
    grads = [p.grad for p in params if p.grad is not None]
    for sync in (trainer.sync, trainer.expert_sync):
        if sync is not None:
            grads += [b.flat for bs in sync.buckets.values() for b in bs]
    if sharded is not None:
        grads += [b.grad_full for b in sharded.buckets if b.grad_full is not None]
    tracker.mark(grads, "gradients")
    states = trainer.optimizer.state.values()
    tracker.mark([t for s in states for t in s.values() if isinstance(t, torch.Tensor)],
                 "optimizer")


def tracked_steps(tracker: MemoryTracker, pm, batch, steps: int) -> None:
    """Build the rank's shard and train `steps` (>= 2) steps under `tracker`, telling it what
    the trainer's tensors are; the peak counted is that of the steps after the first (which
    makes the optimizer's states): a training step's, set-up left out."""
    if steps < 2:
        raise ValueError(f"memory is measured over steps after the first: steps must be >= 2, "
                         f"got {steps}")
    trainer = pm.shard()
    mark_state(tracker, trainer)
    tracker.mark_unmarked("other")   # what set-up keeps: the batch, communication buffers
    tracker.watch_optimizer(trainer.optimizer)
    # gradients autograd makes (sharded ones are copied out of their unit and freed: "other")
    tracker.watch_gradients(trainer.params if trainer.sharded is None else trainer._experts)
    for step in range(steps):
        pm.train_step(*batch)
        mark_state(tracker, trainer)
        if step == 0:
            tracker.reset_peak()


def measure_worker(spec, plan_json: str, steps: int = 2, options: dict | None = None
                   ) -> RankMemory:
    """Runs on every rank: this rank's measured peak over `steps` training steps, with the
    runtime's `options` (TrainOptions fields)."""
    import torch.distributed as dist

    from planner.api import ParallelModel
    from runtime.experts.routing_log import recording
    from runtime.training.trainer import TrainOptions

    torch.manual_seed(0)
    model, batch = meta_model(spec)
    plan = Plan.from_json(plan_json)
    tracker = MemoryTracker()
    with tracker:
        pm = ParallelModel(model, plan, [], batch,
                           lambda params: torch.optim.AdamW(params, lr=1e-4), seed=0,
                           options=TrainOptions(**(options or {})))
        with recording() as routing:
            tracked_steps(tracker, pm, batch, steps)
    return RankMemory(dist.get_rank(), tracker.peak_bytes, tracker.split(), tuple(routing))


def meta_model(spec, lazy_batch: bool = False):
    """(the model on the meta device, its example batch): each rank materialises only its
    shard (planner.weights.materialize), as a run of a model of real size must. With
    lazy_batch the batch is a function, to call where the batch should be made (a dry run
    makes it fake)."""
    from planner.models.presets import ModelConfig, build_model, example_batch
    from planner.training.local import build
    if isinstance(spec, ModelConfig):
        batch = lambda: example_batch(spec, spec.global_batch)  # noqa: E731
        return build_model(spec, device="meta"), batch if lazy_batch else batch()
    if callable(getattr(spec, "model", None)) and callable(getattr(spec, "example", None)):
        # a spec that builds its model on a device and its batch apart (a DiT)
        model = spec.model(device="meta")
        batch = lambda: spec.example(spec.global_batch)  # noqa: E731
        return model, batch if lazy_batch else batch()
    with torch.device("meta"):
        model, _ = build(spec)

    def batch():
        gen_state = torch.random.get_rng_state()
        try:
            return build(spec)[1]   # an HF spec's batch comes with its built model
        finally:
            torch.random.set_rng_state(gen_state)
    return model, batch if lazy_batch else batch()


def predicted_split(plan: Plan) -> list[dict]:
    """The plan's predicted peak per rank (rank order: tp innermost, then cp, dp, pp), split as
    the tracker splits a measurement (Predicted.rank_memory)."""
    if not plan.predicted.rank_memory:
        raise ValueError("the plan holds no per-rank memory prediction (made by an older fxpar): "
                         "plan it again")
    per_rank = plan.gpus // plan.pp
    return [dict(zip(MEMORY_PARTS, plan.predicted.rank_memory[rank // per_rank]))
            for rank in range(plan.gpus)]


def bench_memory(plans: list[Plan], config, steps: int):
    """Each plan's ranks measured on local gloo ranks (`measure_worker`, `steps` steps): its
    heading, then its `memory_table`."""
    import dataclasses

    from planner.search.plan import plural
    from runtime.launch.ranks import run_local
    for i, plan in enumerate(plans):
        spec = dataclasses.replace(config, global_batch=plan.global_batch)
        yield (f"plan {i + 1}: dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} "
               f"zero={plan.zero} {plan.schedule}, {plural(plan.num_microbatches, 'micro-batch')} "
               f"of {plan.micro_batch}; peak live tensor MiB, predicted / measured over {steps} "
               f"steps (the first left out):")
        yield memory_table(plan, run_local(measure_worker, plan.gpus, (spec, plan.dumps(), steps),
                                           timeout_s=600))


def memory_terms(plan) -> str:
    """The fullest rank's predicted peak term by term (planner.search.plan.MEMORY_PARTS, then
    what is not tensors), in GiB."""
    from planner.search.plan import GiB
    p = plan.predicted
    if not p.rank_memory:
        return "no per-rank terms"
    fullest = max(p.rank_memory, key=sum)
    parts = [f"{name} {value / GiB:.1f}" for name, value in zip(MEMORY_PARTS, fullest)]
    return ", ".join(parts + [f"device {p.device_bytes / GiB:.1f}"])


def memory_table(plan: Plan, measured: list[RankMemory]) -> str:
    """Per rank, predicted and measured MiB of each category and of the total."""
    rows = []
    for m, p in zip(measured, predicted_split(plan)):
        cells = [f"{p[k] / MiB:.2f} / {m.split[k] / MiB:.2f}" for k in CATEGORIES]
        total_p = sum(p.values())
        rows.append([m.rank, *cells, f"{total_p / MiB:.2f} / {m.peak_bytes / MiB:.2f}",
                     f"{total_p / m.peak_bytes:.2f}"])
    return tabulate(rows, headers=["rank", *CATEGORIES, "total", "pred/meas"],
                    disable_numparse=True)
