"""Train a plan on local gloo ranks beside the same model in one process, step by step.

Used by `make demo`, `fxpar run` and the distributed tests: the reference is a deep copy of the same
initial model trained on the whole global batch in one process with the same optimizer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from tabulate import tabulate

from planner.models.hf import HFSpec  # re-exported: HFSpec is a model spec
from planner.models.presets import ModelConfig, build_model, example_batch
from planner.search.plan import Plan
from runtime.launch.ranks import RankPool, run_local
from runtime.launch.progress import Progress


def make_optimizer(params):
    """SGD with momentum: its update is linear in the gradient, so a comparison with one process
    sees fp32 summation-order noise as it is (Adam divides by sqrt(v), which turns noise on a
    near-zero gradient into a full learning-rate step)."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


@dataclass(frozen=True)
class RunResult:
    losses: tuple[float, ...]
    state: dict            # full (unsharded) parameters after the last step
    grads: tuple[dict, ...] = ()   # full gradients of each step


def build(spec: ModelConfig | HFSpec):
    """(model, global batch) from a spec, the same on every rank given the same seed; a spec
    other than a ModelConfig builds itself (HFSpec, MixedSpec, a DiT's DiTConfig)."""
    if isinstance(spec, ModelConfig):
        return build_model(spec), example_batch(spec, spec.global_batch)
    return spec.build()


def counted(config, batch: tuple) -> tuple[int, str]:
    """What progress rates count in a batch, and their unit: the first input's tokens, or for a
    model whose inputs are not sequences (a DiT's latents) its samples, as its plan counts
    them."""
    if getattr(config, "sequences", True):
        return batch[0].numel(), "tokens"
    return batch[0].shape[0], "samples"


def loss_of(output):
    """What fxpar trains of forward's result (passes.capture.trace.check_loss): the value, the
    first of a tuple, or a dict's "loss"."""
    if isinstance(output, dict):
        return output["loss"]
    return output[0] if isinstance(output, (tuple, list)) else output


def train_in_one_process(model: torch.nn.Module, batch: tuple, steps: int,
                         on_step=None) -> RunResult:
    """`model` trained in one process on the whole `batch` for `steps` steps with make_optimizer;
    losses, gradients of every step and final parameters. `on_step(seconds, loss)` after each
    step."""
    opt = make_optimizer(list(model.parameters()))
    losses, grads = [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model(*batch))
        loss.backward()
        # a parameter the loss does not read (a vision tower's last layer, whose output a
        # vision-language model leaves out) has no gradient
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(time.perf_counter() - start, losses[-1])
    return RunResult(tuple(losses), {k: v.detach().clone() for k, v in model.named_parameters()},
                     tuple(grads))


def reference_run(config: ModelConfig | HFSpec, steps: int, seed: int = 0,
                  progress: bool = False) -> RunResult:
    torch.manual_seed(seed)
    model, batch = build(config)
    count, unit = counted(config, batch)
    bar = Progress(steps, enabled=progress, rate_unit=unit)
    return train_in_one_process(
        model, batch, steps,
        on_step=lambda seconds, loss: bar.update(per_s=count / seconds,
                                                 loss=loss, label="one process"))


def parallel_worker(config: ModelConfig | HFSpec, plan_json: str, steps: int,
                    with_grads: bool = True, seed: int = 0, progress: bool = False) -> RunResult:
    """Runs on every rank: the same model and batch as the reference, sharded by the plan; with
    with_grads, the unsharded gradients of every step are gathered too (for tests); with
    progress, rank 0 shows each step on stderr (runtime.launch.progress)."""
    import torch.distributed as dist

    from planner.api import ParallelModel

    torch.manual_seed(seed)
    model, batch = build(config)
    plan = Plan.from_json(plan_json)
    pm = ParallelModel(model, plan, [], batch, make_optimizer)
    count, unit = counted(config, batch)
    bar = Progress(steps, enabled=progress and dist.get_rank() == 0, rate_unit=unit)
    losses, grads = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(pm.train_step(*batch))
        bar.update(per_s=count / (time.perf_counter() - start),
                   loss=losses[-1], label=f"{plan.gpus} ranks")
        if with_grads:
            grads.append(pm.full_grad_dict())
    return RunResult(tuple(losses), pm.full_state_dict(), tuple(grads))


def run_parallel(config: ModelConfig | HFSpec, plan: Plan, steps: int,
                 pool: RankPool | None = None, with_grads: bool = True,
                 progress: bool = False) -> RunResult:
    args = (config, plan.dumps(), steps, with_grads, 0, progress)
    results = pool.run(parallel_worker, *args) if pool else run_local(parallel_worker, plan.gpus,
                                                                      args)
    return results[0]


def compare_with_reference(config: ModelConfig | HFSpec, plan: Plan, steps: int = 3) -> float:
    """Print per-step losses side by side; return the largest relative difference. Both runs
    train on the global batch the plan was made for."""
    config = replace(config, global_batch=plan.global_batch)
    print(f"training {steps} steps on {plan.gpus} gloo CPU processes "
          f"(dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp}) and in one process ...",
          flush=True)
    parallel = run_parallel(config, plan, steps, with_grads=False, progress=True)
    return print_comparison(parallel, reference_run(config, steps, progress=True), plan.gpus)


def print_comparison(parallel: RunResult, ref: RunResult, gpus: int, start: int = 0,
                     after: str | None = None) -> float:
    """Print losses per step side by side and the largest parameter difference; return the
    largest relative difference of either. The parallel run's losses are those of steps
    start + 1 onwards (a resumed run), the reference's of every step from 1; `after` names when
    the parameters are compared (default "N steps")."""
    rows, worst = [], 0.0
    for step, (a, b) in enumerate(zip(parallel.losses, ref.losses[start:]), start + 1):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        rows.append([step, f"{a:.6f}", f"{b:.6f}", f"{rel:.2e}"])
    print(tabulate(rows, headers=["step", f"loss on {gpus} ranks", "loss in one process",
                                  "relative difference"]))
    # relative to each tensor's largest value, but for tensors that stay near zero (BART's key
    # biases: no gradient in theory, float noise of 1e-12 in practice), compared to 1e-6
    params = max(float((parallel.state[k] - v).abs().max() / v.abs().max().clamp_min(1e-6))
                 for k, v in ref.state.items())
    after = after or f"{len(ref.losses)} steps"
    print(f"largest relative parameter difference after {after}: {params:.2e}")
    return max(worst, params)


def assert_same_run(parallel: RunResult, reference: RunResult, rtol: float = 1e-5,
                    atol: float = 1e-6, what: str = "") -> None:
    """Raise AssertionError unless the per-step losses (relative), the gradients of every step
    (when both runs recorded them) and the final parameters agree; names what differs."""
    close, prefix = torch.testing.assert_close, f"{what}: " if what else ""
    close(torch.tensor(parallel.losses), torch.tensor(reference.losses), rtol=rtol, atol=0,
          msg=lambda m: f"{prefix}losses: {m}")
    if parallel.state.keys() != reference.state.keys():
        differ = sorted(parallel.state.keys() ^ reference.state.keys())
        raise AssertionError(f"{prefix}parameter names differ: {differ}")
    steps = zip(parallel.grads, reference.grads) if parallel.grads and reference.grads else ()
    for step, (got, want) in enumerate(steps, 1):
        for name, value in want.items():
            close(got[name], value, rtol=rtol, atol=atol,
                  msg=lambda m, n=name, i=step: f"{prefix}step {i} gradient of {n}: {m}")
        for name in got.keys() - want.keys():  # no gradient in one process: none here either
            if got[name] is not None and got[name].count_nonzero():
                raise AssertionError(f"{prefix}step {step}: {name} has a gradient, but the "
                                     f"loss does not read it in one process")
    for name, value in reference.state.items():
        close(parallel.state[name], value, rtol=rtol, atol=atol,
              msg=lambda m, name=name: f"{prefix}final {name}: {m}")
