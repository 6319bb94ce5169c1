"""Train with checkpoints on local gloo ranks, resume under any plan, and the same steps in one
process to compare with: what `fxpar run --checkpoint` and tests/dist/test_checkpoint.py run.

Each step reads the batch at its data position (seeded by the position), so a resumed run that
did not restore its data position would train on other batches and differ from one process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from planner.models.dit import DiTConfig
from planner.models.presets import ModelConfig
from planner.search.plan import Plan
from planner.training.local import build, make_optimizer, print_comparison, counted
from runtime.launch.ranks import run_local
from runtime.launch.progress import Progress

OPTIMIZERS = ("sgd", "adamw")


def optimizer_factory(name: str):
    """SGD with momentum (planner.training.local.make_optimizer) or AdamW, by name (picklable)."""
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


def _batches(config, model, batch):
    """position -> the global batch at that data position: random tokens (batch_at), or a DiT's
    random latents, timesteps, classes and noise, seeded by the position alike."""
    if isinstance(config, DiTConfig):
        return lambda position: config.example(batch[0].shape[0], 1_000_003 + position)
    vocab = _vocab(config, model)
    return lambda position: batch_at(batch, vocab, position)


def _vocab(config, model) -> int:
    if isinstance(config, ModelConfig):
        return config.vocab
    if getattr(config, "config", None) is not None:  # planner.training.pretrained.Source of a preset
        return config.config.vocab
    from planner.models.hf import vocab_size
    return vocab_size(model)


def _is_source(config) -> bool:
    """A planner.training.pretrained.Source (known by its methods: planner.training.pretrained calls this module)."""
    return hasattr(config, "meta_model") and hasattr(config, "full_model")


def _model(config, full: bool):
    """(model, batch, ParallelModel keyword arguments) of a preset, an HFSpec, or a
    planner.training.pretrained.Source (a meta model whose ranks read a Hugging Face checkpoint directory
    or the per-parameter init rule; `full`: its one-process counterpart)."""
    if _is_source(config):
        model = config.full_model() if full else config.meta_model()
        return model, config.batch(), {"weights": config.weights, "seed": config.seed}
    model, batch = build(config)
    return model, batch, {}


@dataclass(frozen=True)
class ResumeResult:
    first_step: int                # the step the run started from (0, or the checkpoint's)
    losses: tuple[float, ...]      # of steps first_step + 1 ... last
    state: dict                    # full parameters after the last step
    saved: tuple[str, ...] = ()    # checkpoint folders written
    draw: tuple[float, float] = (0.0, 0.0)  # draws from torch's two dropout streams at the end
    zero: int = 0                  # the sharded data-parallel level the ranks trained with


def checkpoint_worker(config, plan_json: str, steps: int, root: str | None,
                      save_every: int = 0, resume: bool = False, optimizer: str = "sgd",
                      seed: int = 0, progress: bool = False) -> ResumeResult:
    """On every rank: build the model (`config`: a preset, an HFSpec or a
    planner.training.pretrained.Source), shard it by the plan, with `resume` load the latest
    complete checkpoint under `root` (saved under any plan), train until step `steps`, saving
    into root/step-N every `save_every` steps."""
    import torch.distributed as dist

    from planner.api import ParallelModel
    from runtime.checkpoint import state as checkpoint

    torch.manual_seed(seed)
    model, batch, source = _model(config, full=False)
    draw = _batches(config, model, batch)
    plan = Plan.from_json(plan_json)
    pm = ParallelModel(model, plan, [], batch, optimizer_factory(optimizer), **source)
    if resume:
        pm.load(root)
    first, losses, saved = pm.step, [], []
    bar = Progress(max(steps - first, 0), enabled=progress and dist.get_rank() == 0,
                   rate_unit=counted(config, batch)[1])
    while pm.step < steps:
        start = time.perf_counter()
        tokens = draw(pm.data_position)
        losses.append(pm.train_step(*tokens))
        bar.update(per_s=counted(config, tokens)[0] / (time.perf_counter() - start),
                   loss=losses[-1], label=f"{plan.gpus} ranks, step {pm.step}")
        if save_every and pm.step % save_every == 0:
            saved.append(pm.save(checkpoint.step_dir(root, pm.step)))
    state = pm.full_state_dict()
    zero = getattr(pm.shard().sharded, "level", 0) if getattr(pm.shard(), "sharded", None) else 0
    from runtime.training.rng import tp_generator
    draws = (float(torch.rand(())), float(torch.rand((), generator=tp_generator())))
    return ResumeResult(first, tuple(losses), state, tuple(saved), draws, zero)


def run_with_checkpoints(config, plan: Plan, steps: int, root: str | None, save_every: int = 0,
                         resume: bool = False, optimizer: str = "sgd", pool=None,
                         progress: bool = False) -> ResumeResult:
    """checkpoint_worker on a pool of ranks, or on fresh local gloo ranks without one."""
    args = (config, plan.dumps(), steps, root, save_every, resume, optimizer, 0, progress)
    results = pool.run(checkpoint_worker, *args) if pool else run_local(
        checkpoint_worker, plan.gpus, args)
    return results[0]


def reference_steps(config, steps: int, optimizer: str = "sgd",
                    seed: int = 0) -> ResumeResult:
    """The same steps in one process: the same initial model, batches and optimizer."""
    torch.manual_seed(seed)
    model, batch, _ = _model(config, full=True)
    draw = _batches(config, model, batch)
    opt = optimizer_factory(optimizer)(list(model.parameters()))
    losses, position = [], 0
    for _ in range(steps):
        tokens = draw(position)
        opt.zero_grad()
        loss = model(*tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        position += tokens[0].shape[0]
    return ResumeResult(0, tuple(losses),
                        {k: v.detach().clone() for k, v in model.named_parameters()})


def check_resume_request(root: str | None, save_every: int, resume: bool, steps: int) -> int:
    """The step a run with these checkpoint options starts from; a one-line error for a request
    that cannot do what it says."""
    from runtime.checkpoint import state as checkpoint
    if (save_every or resume) and not root:
        flag = "--save-every" if save_every else "--resume"
        raise ValueError(f"{flag} needs --checkpoint DIR (the folder of step-N checkpoints)")
    if not resume:
        return 0
    start = checkpoint.read_marker(root)["step"]
    if start >= steps:
        raise ValueError(f"the latest checkpoint in {root} is at step {start}, which --steps "
                         f"{steps} does not pass; ask for more steps")
    return start


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def compare_resumed(config, plan: Plan, steps: int, root: str | None, save_every: int = 0,
                    resume: bool = False) -> float:
    """`fxpar run --checkpoint`: train on local gloo ranks (from the latest checkpoint with
    resume), saving every save_every steps, and print each step's loss beside one process
    trained from step 0 on the same batches; returns the largest relative difference."""
    start = check_resume_request(root, save_every, resume, steps)
    every = "every step" if save_every == 1 else f"every {save_every} steps"
    print(f"training {_steps(start + 1, steps)} on {plan.gpus} gloo CPU processes (dp={plan.dp} "
          f"tp={plan.tp} pp={plan.pp} cp={plan.cp})"
          + (f", from the checkpoint of step {start} in {root}" if resume else "")
          + (f", saving {every} into {root}" if save_every else "")
          + f"; and {_steps(1, steps)} in one process ...", flush=True)
    parallel = run_with_checkpoints(config, plan, steps, root, save_every, resume,
                                    progress=True)
    worst = print_comparison(parallel, reference_steps(config, steps), plan.gpus, start,
                             after=f"step {steps}")
    for path in parallel.saved:
        print(f"saved {path}")
    return worst
