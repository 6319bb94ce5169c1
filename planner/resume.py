"""Train with checkpoints on local gloo ranks, resume under any plan, and the same steps in one
process to compare with: what `fxpar run --checkpoint` and tests/dist/test_checkpoint.py run.

Each step reads the batch at its data position (seeded by the position), so a resumed run that
did not restore its data position would train on other batches and differ from one process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from planner.models import ModelConfig
from planner.plan import Plan
from planner.train import HFSpec, build, make_optimizer
from runtime.launch import run_local
from runtime.progress import Progress

OPTIMIZERS = ("sgd", "adamw")


def optimizer_factory(name: str):
    """SGD with momentum (planner.train.make_optimizer) or AdamW, by name (picklable)."""
    if name == "sgd":
        return make_optimizer
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def batch_at(batch: tuple[torch.Tensor, ...], vocab: int, position: int):
    """The global batch starting at data position `position`: random tokens seeded by it, shaped
    like `batch`."""
    gen = torch.Generator().manual_seed(1_000_003 + position)
    return tuple(torch.randint(0, vocab, t.shape, generator=gen) for t in batch)


def _vocab(config, model) -> int:
    if isinstance(config, ModelConfig):
        return config.vocab
    from planner.hf import vocab_size
    return vocab_size(model)


@dataclass(frozen=True)
class ResumeResult:
    first_step: int                # the step the run started from (0, or the checkpoint's)
    losses: tuple[float, ...]      # of steps first_step + 1 ... last
    state: dict                    # full parameters after the last step
    saved: tuple[str, ...] = ()    # checkpoint folders written


def checkpoint_worker(config: ModelConfig | HFSpec, plan_json: str, steps: int, root: str | None,
                      save_every: int = 0, resume: bool = False, optimizer: str = "sgd",
                      seed: int = 0, progress: bool = False) -> ResumeResult:
    """On every rank: build the model, shard it by the plan, with `resume` load the latest
    complete checkpoint under `root` (saved under any plan), train until step `steps`, saving
    into root/step-N every `save_every` steps."""
    import torch.distributed as dist

    from planner.api import ParallelModel
    from runtime import checkpoint

    torch.manual_seed(seed)
    model, batch = build(config)
    vocab = _vocab(config, model)
    plan = Plan.from_json(plan_json)
    pm = ParallelModel(model, plan, [], batch, optimizer_factory(optimizer))
    if resume:
        pm.load(root)
    first, losses, saved = pm.step, [], []
    bar = Progress(max(steps - first, 0), enabled=progress and dist.get_rank() == 0)
    while pm.step < steps:
        start = time.perf_counter()
        tokens = batch_at(batch, vocab, pm.data_position)
        losses.append(pm.train_step(*tokens))
        bar.update(tokens_per_s=tokens[0].numel() / (time.perf_counter() - start),
                   loss=losses[-1], label=f"{plan.gpus} ranks, step {pm.step}")
        if save_every and pm.step % save_every == 0:
            saved.append(pm.save(checkpoint.step_dir(root, pm.step)))
    return ResumeResult(first, tuple(losses), pm.full_state_dict(), tuple(saved))


def run_with_checkpoints(config, plan: Plan, steps: int, root: str | None, save_every: int = 0,
                         resume: bool = False, optimizer: str = "sgd", pool=None,
                         progress: bool = False) -> ResumeResult:
    """checkpoint_worker on a pool of ranks, or on fresh local gloo ranks without one."""
    args = (config, plan.dumps(), steps, root, save_every, resume, optimizer, 0, progress)
    results = pool.run(checkpoint_worker, *args) if pool else run_local(
        checkpoint_worker, plan.gpus, args)
    return results[0]


def reference_steps(config: ModelConfig | HFSpec, steps: int, optimizer: str = "sgd",
                    seed: int = 0) -> ResumeResult:
    """The same steps in one process: the same initial model, batches and optimizer."""
    torch.manual_seed(seed)
    model, batch = build(config)
    vocab = _vocab(config, model)
    opt = optimizer_factory(optimizer)(list(model.parameters()))
    losses, position = [], 0
    for _ in range(steps):
        tokens = batch_at(batch, vocab, position)
        opt.zero_grad()
        loss = model(*tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        position += tokens[0].shape[0]
    return ResumeResult(0, tuple(losses),
                        {k: v.detach().clone() for k, v in model.named_parameters()})
