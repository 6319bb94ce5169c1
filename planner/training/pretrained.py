"""Training a model that no rank holds whole: a meta-device preset (initialised per shard) or a
Hugging Face checkpoint directory (each rank reads its slices), beside its one-process counterpart.

Used by `fxpar run --weights DIR`, the distributed tests and examples/bench_setup_memory.py. The
one-process counterpart of a preset is `planner.weights.materialize.materialize_full` (the same rule, one
parameter at a time); of a checkpoint, `transformers`' own `from_pretrained`, so that the
comparison is with the library that wrote the files.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from planner.models.presets import ModelConfig, build_model, example_batch
from planner.search.plan import Plan
from planner.training.local import RunResult, make_optimizer, print_comparison, train_in_one_process


@dataclass(frozen=True)
class Source:
    """What to train: a preset built on the meta device (`config`), or a checkpoint directory
    (`weights`: its config.json and safetensors), with the global batch size and the seed of
    the init rule (presets) and of the batch."""

    config: ModelConfig | None = None
    weights: str | None = None
    global_batch: int = 16
    seed: int = 0

    def __post_init__(self):
        if (self.config is None) == (self.weights is None):
            raise ValueError("give exactly one of config= (a preset) and weights= (a Hugging "
                             "Face checkpoint directory)")

    def meta_model(self) -> torch.nn.Module:
        if self.config is not None:
            return build_model(self.config, device="meta")
        from planner.weights.hf_weights import hf_model
        return hf_model(self.weights)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config is not None:
            return example_batch(self.config, self.global_batch, seed=self.seed)
        config = self._hf_config()   # no model built: the batch needs two sizes only
        seq = config.get("n_positions") or config.get("max_position_embeddings")
        if not seq:
            raise ValueError(f"{self.weights}/config.json has neither n_positions nor "
                             f"max_position_embeddings: the sequence length is unknown")
        gen = torch.Generator().manual_seed(self.seed)
        return tuple(torch.randint(0, config["vocab_size"], (self.global_batch, seq),
                                   generator=gen) for _ in "xy")

    def _hf_config(self) -> dict:
        import json
        import os
        with open(os.path.join(self.weights, "config.json"), encoding="utf-8") as f:
            return json.load(f)

    def full_model(self) -> torch.nn.Module:
        """The one-process counterpart, with every weight."""
        if self.config is not None:
            from planner.weights.materialize import materialize_full
            return materialize_full(self.meta_model(), self.seed)
        from planner.models.hf import HFCausalLM, _transformers
        tf = _transformers()
        return HFCausalLM(tf.AutoModelForCausalLM.from_pretrained(self.weights,
                                                                  dtype=torch.float32))


def train_one_process(source: Source, steps: int) -> RunResult:
    """The full model trained in one process on the global batch, with planner.training.local's
    optimizer; losses, gradients of every step and final parameters."""
    model, batch = source.full_model(), source.batch()
    return train_in_one_process(model, batch, steps)


def parallel_worker(source: Source, plan_json: str, steps: int, with_grads: bool = True,
                    on_step=None) -> RunResult:
    """Runs on every rank: the meta model, this rank's shard given its values (init rule or
    checkpoint slices), trained by the plan. `on_step(step, seconds, loss)` on every rank."""
    from planner.api import ParallelModel

    plan = Plan.from_json(plan_json)
    batch = source.batch()
    pm = ParallelModel(source.meta_model(), plan, [], batch, make_optimizer,
                       weights=source.weights, seed=source.seed)
    losses, grads = [], []
    for step in range(steps):
        start = time.perf_counter()
        losses.append(pm.train_step(*batch))
        if on_step is not None:
            on_step(step + 1, time.perf_counter() - start, losses[-1])
        if with_grads:
            grads.append(pm.full_grad_dict())
    return RunResult(tuple(losses), pm.full_state_dict(), tuple(grads))


def plan_for(source: Source, gpus: int, fix: dict | None = None, cluster: str = "cpu-gloo",
             memory_limit: float | None = None) -> Plan:
    """The best plan for the source's model on `gpus` devices (planned on the meta device)."""
    from planner.api import plan
    return plan(source.meta_model(), gpus, source.batch(), cluster=cluster, fix=fix,
                memory_limit=memory_limit)[0]


def run_parallel(source: Source, plan: Plan, steps: int, pool=None,
                 with_grads: bool = True) -> RunResult:
    """Train on the plan's number of local gloo ranks (or a test pool); rank 0's result."""
    from runtime.launch.ranks import run_local
    args = (source, plan.dumps(), steps, with_grads)
    results = pool.run(parallel_worker, *args) if pool else run_local(parallel_worker,
                                                                      plan.gpus, args)
    return results[0]


def compare(source: Source, plan: Plan, steps: int) -> float:
    """Train on local gloo ranks and in one process; print the losses side by side and return
    the largest relative difference (losses and final parameters)."""
    what = source.weights or source.config.name
    print(f"training {what} for {steps} steps on {plan.gpus} gloo CPU processes (dp={plan.dp} "
          f"tp={plan.tp} pp={plan.pp} cp={plan.cp}), each rank materialising only its shard, "
          f"and in one process ...", flush=True)
    parallel = run_parallel(source, plan, steps, with_grads=False)
    return print_comparison(parallel, train_one_process(source, steps), plan.gpus)


def cmd_run_weights(args) -> int:
    """`fxpar run --weights DIR`: plan the checkpoint's model, train it on local gloo ranks (each
    reading its slices of the files) beside transformers' from_pretrained in one process."""
    given = [f"--{k.replace('_', '-')}" for k in ("layers", "hidden", "heads", "kv_heads",
                                                  "vocab", "seq") if getattr(args, k, None)]
    if args.hf or args.hf_config or given:
        raise ValueError(f"--weights DIR takes the model and its sizes from DIR/config.json; "
                         f"leave out {', '.join(given) or '--hf / --hf-config'}")
    if args.torchrun:
        raise ValueError("--weights trains on local gloo ranks; for a cluster, call "
                         "autoparallelize(model, gpus, batch, weights=DIR) under torchrun")
    source = Source(weights=args.weights, global_batch=args.global_batch or 16)
    best = plan_for(source, args.gpus, args.fix, args.cluster, args.memory_limit)
    print(best)
    print()
    if args.checkpoint or args.save_every or args.resume:  # planner.training.resume
        from planner.training.resume import compare_resumed
        compare_resumed(source, best, args.steps, args.checkpoint, args.save_every, args.resume)
        return 0
    compare(source, best, args.steps)
    return 0
