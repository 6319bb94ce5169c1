"""`autoparallelize`: trace, price, solve; and, inside a distributed launch, shard and train."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import inspect
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from cost_model.hardware.cluster import Cluster, get_cluster
from cost_model.layers.memory import TrainingMemory
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from passes.rewrite.sum_losses import baked_batch
from passes.rewrite.token_mean import targets_from_modules
from passes.stages.program import rank_programs
from planner.search.experts import search_experts
from planner.models.loss import with_loss
from planner.models.moe_config import captured_config, preset_runs
from planner.weights.materialize import capture_inputs, give_values, value_source
from planner.models.presets import (ModelConfig, build_model, example_batch, get_config,
                                     is_preset)
from planner.models.random_draws import random_notes
from planner.models.structure import carried_notes, structure_notes
from planner.search.plan import GiB, Plan, gib
from planner.search.costs import ModelCosts, PlanningError
from planner.search.refusals import why_nothing_plans
from planner.search.meshes import Request, check_fix, search, smallest_memory
from runtime.training.batch import BatchSpec
from runtime.experts.dispatch import bind_ep_group, expert_groups
from runtime.pipeline.generators import make_schedule
from runtime.comm.mesh import Mesh, mesh_groups
from runtime.programs.shards import shard_specs
from runtime.training.tied import canonical_names
from runtime.training.trainer import PipelineTrainer, TrainOptions


def _check_gpus(gpus) -> int:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    return gpus


def default_cluster() -> str:
    return "a100-80g-dgx" if torch.cuda.is_available() else "cpu-gloo"


def plan(model: str | ModelConfig | torch.nn.Module, gpus: int, example_inputs=None, *,
         cluster: str | Cluster | None = None, global_batch: int | None = None,
         seq: int | None = None, memory_limit: float | None = None, fix: dict | None = None,
         top_k: int = 1, zero1: bool = False, loss_fn: Callable | None = None,
         moe_imbalance: float | None = None, sequence_dim: int | None = 1,
         sizes_from: str | None = None, runtime: str | None = None,
         autocast: str | None = None) -> list[Plan]:
    """The best plans, fastest first. memory_limit is in GiB per device (default: the cluster's
    device memory). Raises PlanningError, saying why, when none fits. loss_fn: see
    planner.models.loss (for a module whose forward does not return the loss).

    For a module, the global batch is dim 0 of the first example input and the sequence its
    dim 1 (`sequence_dim`); `sequence_dim=None` says the inputs are not sequences (images,
    feature vectors): the plan counts samples, and context parallelism is left out. The plan
    states where each size came from; `sizes_from` replaces that text (the command line says
    which flag or config field it read). `runtime` names the training framework the plan is
    priced for (cost_model.hardware.runtimes: fxpar, megatron, torchtitan, ...; default fxpar's
    own); a Cluster passed in is priced as it is. `autocast` ("bf16", "fp16") prices the
    activations as the runtime's precision of that name saves them: 16-bit matmuls over the
    model's fp32 weights (runtime.training.trainer; bf16 weights are planned as they are)."""
    gpus = _check_gpus(gpus)
    model = with_loss(model, loss_fn)
    hw = with_runtime(cluster or default_cluster(), runtime)
    limit = _memory_limit_bytes(memory_limit, hw)
    fix = dict(fix or {})
    if zero1:  # ZeRO stage 1, as the sharded-data-parallel level of the search
        if fix.setdefault("zero", 1) != 1:
            raise ValueError(f"zero1 contradicts zero={fix['zero']}; give one of them")
    check_fix(fix)
    if is_preset(model) and not getattr(get_config(model), "sequences", True):
        sequence_dim = _not_sequences(get_config(model), fix)
    if sequence_dim not in (1, None):
        raise ValueError(f"sequence_dim={sequence_dim!r}: fxpar splits sequences on dim 1 of the "
                         f"inputs (batch on dim 0); transpose the inputs, or say "
                         f"sequence_dim=None if they are not sequences")
    if sequence_dim is None:
        if fix.setdefault("cp", 1) != 1:
            raise ValueError(f"cp={fix['cp']} splits a sequence; sequence_dim=None says the "
                             f"inputs have none")
        if not is_preset(model) and Strategy.parse(fix.get("strategy", "none")).sp:
            raise ValueError(f"strategy={fix['strategy']} splits a sequence (sp: sequence "
                             f"parallelism); sequence_dim=None says the inputs have none: "
                             f"fix strategy='tp' instead")
    asked_seq = seq
    costs, name, batch, seq = _model_costs(model, example_inputs, global_batch, seq, zero1,
                                           fp32=hw.runtime_priced or hw.device == "cpu" or
                                           bool(autocast), sequences=sequence_dim == 1,
                                           autocast=autocast)
    if sizes_from is None:
        sizes_from = _sizes_from(model, example_inputs, global_batch, asked_seq, seq,
                                 sequence_dim == 1)
    req = Request(gpus, hw, batch, seq, limit, name, fix, top_k=top_k, sizes_from=sizes_from,
                  sequences=sequence_dim == 1)
    return plan_costs(costs, req, moe_imbalance)


def _not_sequences(cfg, fix: dict) -> None:
    """sequence_dim of a preset whose inputs are not sequences (a DiT's latent images): None,
    with context parallelism (which cuts dim 1 of the inputs) left out."""
    if fix.setdefault("cp", 1) != 1:
        raise ValueError(f"cp={fix['cp']}: {cfg.name}'s inputs are latent images, which context "
                         f"parallelism (a split of dim 1 of token inputs) does not cut; leave cp "
                         f"out, or use tp+sp to split its patches")
    return None


def with_runtime(cluster: str | Cluster, runtime: str | None = None) -> Cluster:
    """The cluster preset or profile under a runtime profile (default fxpar's own); a Cluster
    that names its runtime already (runtimes.apply) is priced as it is."""
    from cost_model.hardware.runtimes import apply
    if isinstance(cluster, Cluster) and cluster.runtime:
        if runtime is not None and runtime != cluster.runtime:
            raise ValueError(f"cluster {cluster.name} is already priced for the "
                             f"{cluster.runtime} runtime; pass the hardware profile (its name, "
                             f"or a Cluster without a runtime) to price it for {runtime}")
        return cluster
    return apply(get_cluster(cluster), runtime)


def _sizes_from(model, example_inputs, global_batch, asked_seq, seq: int,
                sequences: bool) -> str:
    """Where the plan's sequence length and global batch came from, as the plan states it."""
    if is_preset(model):
        config = get_config(model)
        if hasattr(config, "sizes_text"):
            return config.sizes_text(bool(global_batch))
        return (f"seq {seq}: {_config_size(config, 'seq', asked_seq)}   global batch: "
                f"{_config_size(config, 'global_batch', global_batch)}")
    shape = list(example_inputs[0].shape)
    batch = "given" if global_batch else f"dim 0 of the first example input {shape}"
    if not sequences:
        return f"inputs not sequences (counted in samples)   global batch: {batch}"
    return (f"seq {seq}: dim 1 of the first example input {shape} (sequence_dim=None if it is "
            f"not a sequence)   global batch: {batch}")


def _config_size(config, field: str, asked) -> str:
    """'given' where the size was asked for or differs from the named preset's (a size flag or
    override), 'preset' where it is the preset's own, 'config' for a config of no preset."""
    from planner.models.presets import PRESETS
    base = PRESETS.get(config.name)
    if asked or (base is not None and getattr(base, field) != getattr(config, field)):
        return "given"
    return "preset" if base is not None else "config"


def plan_costs(costs: ModelCosts, req: Request, moe_imbalance: float | None = None) -> list[Plan]:
    """`plan` for a model already captured and profiled (`_model_costs`): the search alone, so
    that one capture serves several clusters (planner.bench.published fits constants so)."""
    plans = search_experts(costs, req, search, moe_imbalance)  # every ep size (dense: ep=1)
    if not plans:
        raise _infeasible(costs, req)
    return plans


def _memory_limit_bytes(memory_limit, hw: Cluster) -> float:
    """A memory limit in GiB per device, as bytes; None: the cluster's device memory."""
    if memory_limit is None:
        return float(hw.mem_bytes)
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
            or not memory_limit > 0:
        raise ValueError(f"memory limit must be a positive number of GiB per device, got "
                         f"{memory_limit!r}")
    return float(memory_limit) * GiB


def _infeasible(costs: ModelCosts, req: Request) -> PlanningError:
    """Why nothing planned: the filter that removed the last configurations and the nearest legal
    value, or the least memory any plan needs."""
    why = why_nothing_plans(costs, req)
    if why:
        return PlanningError(why)
    need, where = smallest_memory(costs, req)
    if where is None:
        return PlanningError(f"no configuration of {req.gpus} GPUs fits the model and global "
                             f"batch {req.global_batch} (fixed: {req.fix or 'nothing'}): every "
                             f"stage problem is infeasible")
    cp = f", cp={where.cp}" if where.cp > 1 else ""
    cp += f", zero={where.zero}" if where.zero else ""
    cp += f", dp_shard={where.dp_shard}" if where.dp_shard else ""
    return PlanningError(
        f"no plan fits in {gib(req.memory_limit)} GiB per device; the smallest memory per device "
        f"any plan needs is {gib(need, up=True)} GiB (dp={where.dp}, tp={where.tp}, "
        f"pp={where.pp}{cp}, {where.schedule}, micro-batch {where.micro_batch}); raise the memory "
        f"limit (GiB) to at least that or use more GPUs")


def _model_costs(model, example_inputs, global_batch, seq, zero1: bool = False,
                 fp32: bool = False, sequences: bool = True, autocast: str | None = None):
    """Capture the model on fake tensors. A config is captured with one block (blocks are identical,
    so one is priced and counted N times), which keeps planning GPT-3 a matter of seconds. A
    config is planned for bf16 mixed precision, or with fp32 for fp32 training (what CPU ranks
    run, on a profile calibrated on them: Cluster.runtime_priced)."""
    if is_preset(model):
        cfg = get_config(model, seq=seq)
        _, runs = preset_runs(cfg)  # one block per kind (MoE: dense first blocks, then MoE)
        dtype_bytes = 4 if fp32 else 2
        dtype = torch.float32 if fp32 else torch.bfloat16
        meta = build_model(captured_config(cfg), device="meta", dtype=dtype)
        captured = capture(meta, example_batch(cfg, 1, device="meta", dtype=dtype))
        training = TrainingMemory.for_dtype(dtype_bytes, zero1=zero1)
        return (ModelCosts(captured, cfg.layers, dtype_bytes, training, runs=runs,
                           autocast=_autocast(autocast, dtype)), cfg.name,
                global_batch or cfg.global_batch, cfg.seq)
    if example_inputs is None:
        raise ValueError("a model given as an nn.Module needs example_inputs=(...) with the "
                         "global batch on dim 0")
    check_example_inputs(model, example_inputs)
    captured = _capture(model, capture_inputs(model, tuple(x[:1] for x in example_inputs)))
    batch = global_batch or example_inputs[0].shape[0]
    seq = example_inputs[0].shape[1] if example_inputs[0].dim() > 1 and sequences else 1
    dtype_bytes = next(model.parameters()).element_size()
    training = TrainingMemory.for_dtype(dtype_bytes, zero1=zero1)
    costs = ModelCosts(captured, len(captured.blocks), dtype_bytes, training,
                       autocast=_autocast(autocast, next(model.parameters()).dtype))
    if example_inputs[0].shape[0] > 1:  # what one sample cannot show (ModelCosts.capture_wide)
        costs.capture_wide = lambda: _capture(model, capture_inputs(
            model, tuple(x[:2] for x in example_inputs)))
    costs.structure_notes = (structure_notes(model, captured.parts) + carried_notes(captured)
                             + random_notes(captured))
    own_notes = getattr(model, "fxpar_plan_notes", None)  # what the model's inputs mean
    if callable(own_notes):
        costs.structure_notes += tuple(own_notes(example_inputs))
    return costs, getattr(model, "fxpar_name", type(model).__name__), batch, seq


def check_example_inputs(model: torch.nn.Module, example_inputs) -> None:
    """Every example input must be a tensor with the batch on dim 0: fxpar cuts each one into
    micro-batches (and the batch train_step is given the same way). A constant argument - a flag,
    a label smoothing - is refused, named, rather than failing inside the cut."""
    if not isinstance(example_inputs, (tuple, list)):
        raise ValueError(f"example_inputs must be a tuple of the tensors forward takes, got "
                         f"{type(example_inputs).__name__}: pass (x,) for a single input")
    names = _forward_names(model)
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            continue
        name = f" ({names[i]})" if i < len(names) else ""
        what = ("a 0-dim tensor" if isinstance(x, torch.Tensor) else "None" if x is None
                else f"a {type(x).__name__} ({repr(x)[:40]})")
        attribute = f"self.{names[i]}" if i < len(names) else "an attribute"
        raise ValueError(f"example_inputs[{i}]{name} is {what}, not a tensor with the batch on "
                         f"dim 0: fxpar cuts every input into micro-batches; bind a constant in "
                         f"the model instead - leave it to forward's default, or set it as a "
                         f"module attribute forward reads ({attribute}) - and pass tensors only")


def _forward_names(model: torch.nn.Module) -> list[str]:
    """The names of forward's positional parameters, for messages ([] where unknown)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _autocast(autocast: str | None, weights: torch.dtype) -> str:
    """The autocast a plan prices ("" for none), checked against the weights it casts."""
    from cost_model.layers.autocast_saved import AUTOCAST_DTYPES
    if not autocast:
        return ""
    if autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast={autocast!r}: give one of {', '.join(AUTOCAST_DTYPES)} "
                         f"(or None for no autocast)")
    if weights != torch.float32:
        raise ValueError(f"autocast={autocast} casts fp32 weights, but the model's are {weights}: "
                         f"leave autocast out (a bf16 model trains in bf16-main, as planned)")
    return autocast


def _capture(model: torch.nn.Module, inputs: tuple, parts=None):
    """capture, with a vision-language model's count of image tokens checked per sample in the
    graph (planner.models.hf_vlm.fixed_image_merge: transformers counts them from the tokens'
    values, which cannot be captured); the ranks run the captured graph, check included. A loss
    whose targets the trainer cannot count apart from the model, or that export baked a batch
    size into, is refused here."""
    from planner.models.hf_vlm import fixed_image_merge
    with fixed_image_merge(model):
        captured = capture(model, inputs, parts=parts)
    why = targets_from_modules(captured.gm)  # else every rank would fail at the first step
    if captured.method == "export":  # sizes read from tensors are constants there
        why = why or baked_batch(captured.gm, captured.batch)
    if why:
        raise ValueError(why)
    return captured


class ParallelModel:
    """A planned model. Inside a distributed launch whose world size equals the plan's GPU count,
    `train_step` runs one 1F1B iteration on this rank's shard."""

    def __init__(self, model: torch.nn.Module | None, plan: Plan, alternatives: list[Plan],
                 example_inputs=None, optimizer=None, weights: str | None = None, seed: int = 0,
                 options: TrainOptions | None = None):
        self.plan = plan
        self.options = options   # clipping, precision, ...; zero and dp_shard come from the plan
        self.weights, self.seed = weights, seed   # planner.weights.materialize: values of a meta model
        self.alternatives = alternatives
        self.model = model
        self._example_inputs = example_inputs
        self._optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self._trainer: PipelineTrainer | None = None
        self.step = 0            # iterations trained (saved and restored by save / load)
        self.data_position = 0   # samples consumed: the next batch starts here (yours to set)

    def __repr__(self) -> str:
        return str(self.plan)

    def shard(self) -> PipelineTrainer:
        """Build this rank's stage programs (done on the first train_step)."""
        if self._trainer is None:
            self._trainer = build_trainer(self.model, self.plan, self._example_inputs,
                                          self._optimizer, weights=self.weights, seed=self.seed,
                                          options=self.options)
        return self._trainer

    def train_step(self, *batch: torch.Tensor) -> float:
        """One iteration over the global batch (the same tensors on every rank); returns the loss."""
        loss = self.shard().step(*batch)
        self.step += 1
        self.data_position += batch[0].shape[0]
        return loss

    def save(self, path: str, extra: dict | None = None) -> str:
        """Save parameters, optimizer state, step, data position, RNG states, the loss scale and
        `extra` (picklable) as a torch.distributed.checkpoint folder that loads under any plan
        (runtime.checkpoint.state; collective: every rank calls it). Returns its absolute path."""
        from planner.weights.export import model_files
        from runtime.checkpoint import state as checkpoint
        info = {"step": self.step, "data_position": self.data_position, "extra": extra}
        return checkpoint.save(self.shard(), path, info, model_files(self.model), self.model)

    def load(self, path: str) -> dict:
        """Load a checkpoint folder, or the latest complete one under a folder of step-N
        checkpoints, saved under any plan; restores step and data_position and returns the
        saved info (its `extra` too)."""
        from runtime.checkpoint import state as checkpoint
        info = checkpoint.load(self.shard(), path, self.model)
        self.step, self.data_position = info["step"], info["data_position"]
        return info

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, on every rank (for checkpoints and comparisons). A
        parameter forward never reads is in no stage program: it gets no gradient, so it keeps
        the model's own value, as in one process (absent where the model is on the meta
        device and has none)."""
        full = gather_full_state(self.shard())
        unread = {name: p.detach().clone() for name, p in self.model.named_parameters()
                  if name not in full and not p.is_meta}
        return {**unread, **full}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every gradient of the last step (averaged over replicas), unsharded, on every rank."""
        return gather_full_state(self.shard(), grads=True)

    def close(self) -> None:
        """End the run on this rank (collective: every rank calls it after its last step): the
        shard and the process groups it holds (data-parallel, pipeline, ...) are freed while
        they still work, then every group is destroyed. Left to interpreter exit, gloo's threads
        can outlive the default group and abort the process ("terminate called without an
        active exception", about one run in four with two data-parallel ranks)."""
        self._trainer = None
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def build_trainer(model, plan: Plan, example_inputs, optimizer: Callable,
                  weights: str | None = None, seed: int = 0,
                  options: TrainOptions | None = None) -> PipelineTrainer:
    if model is None or not isinstance(model, torch.nn.Module):
        raise ValueError("training needs the model as an nn.Module")
    world = dist.get_world_size()
    if world != plan.gpus:
        raise RuntimeError(f"the plan is for {plan.gpus} GPUs but the world size is {world}; "
                           f"launch with --nproc-per-node {plan.gpus} or plan for {world} GPUs")
    groups = mesh_groups(Mesh(plan.pp, plan.dp, plan.tp, plan.cp))
    check_example_inputs(model, example_inputs)
    given = example_inputs   # what train_step will be given: floats are cast at each step
    if options is not None and options.precision == "bf16-main":
        model, example_inputs = in_compute_dtype(model, example_inputs)
    values = value_source(model, weights, seed)  # None: sharded from the model's own weights
    micro = capture_inputs(model, tuple(x[: plan.micro_batch] for x in example_inputs))
    captured = _capture(model, micro, parts=plan.parts() or None)
    layout = plan.layout()
    if len(captured.layers) != sum(layout.stage_sizes):
        raise ValueError(f"the plan covers {sum(layout.stage_sizes)} layers, the model has "
                         f"{len(captured.layers)}")
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    experts = expert_groups(groups.mesh, plan.ep) if plan.ep > 1 else None
    bind_ep_group(experts.group if experts else None)
    programs = rank_programs(captured, layout, groups.tp_index,
                             schedule.stages_of(groups.pp_index), groups.cp_index,
                             experts.index if experts else 0)
    give_values(programs, values, captured.tied)  # a meta model, or weights=DIR
    split = (f"dp {plan.dp} x {plan.num_microbatches} micro-batches x {plan.micro_batch}")
    batch = BatchSpec.of(captured.input_names, given, plan.global_batch, split)
    options = dataclasses.replace(options or TrainOptions(), zero=plan.zero,
                                  dp_shard=plan.dp_shard)  # runtime.data_parallel.sharded_dp
    options = dataclasses.replace(options, split_backward=_split_backward(plan, options),
                                  precision=_precision(plan, options))
    return PipelineTrainer(programs, schedule, groups, captured.input_names, optimizer,
                           tied=captured.tied, batch=batch, experts=experts, options=options)


def _precision(plan: Plan, options: TrainOptions) -> str:
    """The runtime's precision: the plan's autocast where it priced one ("auto" takes it, another
    is refused); autocast asked of a plan that priced none trains, with a warning that its
    activations were priced in the weights' dtype."""
    asked = options.precision
    if plan.autocast:
        if asked not in ("auto", plan.autocast):
            raise ValueError(f"precision={asked} was asked but the plan was priced under autocast "
                             f"{plan.autocast}; plan without autocast (or with autocast={asked!r} "
                             f"for bf16/fp16) to train so")
        return plan.autocast
    if asked in ("bf16", "fp16"):
        warnings.warn(f"precision {asked} (autocast) was not priced by the plan, whose activations "
                      f"are priced in the weights' dtype; plan with autocast={asked!r} (fxpar plan "
                      f"--autocast {asked}) for its memory", stacklevel=3)
    return asked


def _split_backward(plan: Plan, options: TrainOptions) -> str:
    """ZB-H1's split backward as the plan priced it (Plan.split_backward); another one asked
    of a ZB-H1 plan is refused, since its memory and time were not priced."""
    planned = plan.split_backward or "retraverse"
    asked = options.split_backward
    if asked not in ("auto", planned) and plan.schedule == "zb-h1" and plan.pp > 1:
        raise ValueError(f"split_backward={asked} was asked but the plan was priced with "
                         f"split_backward={planned}; plan with --fix split_backward={asked} "
                         f"(fix={{'split_backward': {asked!r}}}) to train so")
    return planned


def in_compute_dtype(model: torch.nn.Module, example_inputs):
    """The model and its example inputs in bf16 for precision "bf16-main"
    (runtime.training.main_weights): its floating weights and buffers are cast in place, as
    model.to(torch.bfloat16) does, before it is captured, so that the captured graph computes
    in bf16 (a cast a model makes to its own dtype is traced at that dtype). A dry run's fake
    mode is left for the cast: a meta model's weights stay meta (nothing is allocated), and
    tied ones stay one parameter."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from runtime.training.main_weights import COMPUTE_DTYPE, compute_inputs
    with unset_fake_temporarily():
        model = model.to(COMPUTE_DTYPE)
    return model, compute_inputs(example_inputs)


def gather_full_state(trainer: PipelineTrainer, grads: bool = False) -> dict[str, torch.Tensor]:
    """Unshard tensor-parallel parameters (or, with grads=True, their gradients) and collect every
    stage's on every rank."""
    groups = trainer.groups
    canonical = canonical_names(tuple(c.names for c in trainer.tied))
    mine = {}
    sharded = trainer.sharded.full_tensors(grads) if trainer.sharded else contextlib.nullcontext()
    with sharded:  # sharded data parallel: the whole parameters (and gradients) for a moment
        _collect_full(trainer, grads, groups, canonical, mine)
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    return {k: v for part in everything for k, v in part.items()}


def _collect_full(trainer, grads, groups, canonical, mine) -> None:
    for program in trainer.programs.values():
        specs = shard_specs(program.gm)
        for name, param in program.gm.named_parameters():
            if grads and param.grad is None:  # the loss does not read it (alike on every rank)
                continue
            value = (param.grad if grads else param).detach().clone()
            if name in specs and groups.tp is not None:
                shards = [torch.empty_like(value) for _ in range(groups.mesh.tp)]
                dist.all_gather(shards, value.contiguous(), group=groups.tp)
                value = specs[name].join(shards)
            expert = getattr(param, "fxpar_expert", None)
            if expert is not None and trainer.experts.group is not None:
                value = expert.join(_gather(value, trainer.experts))
            mine[canonical.get(name, name)] = value


def _gather(value: torch.Tensor, experts) -> list[torch.Tensor]:
    """Every EP rank's experts of one weight, in EP-index order."""
    parts = [torch.empty_like(value) for _ in range(experts.ep)]
    dist.all_gather(parts, value.contiguous(), group=experts.group)
    return parts


def autoparallelize(model: str | ModelConfig | torch.nn.Module, gpus: int, example_inputs=None,
                    *, cluster: str | Cluster | None = None, global_batch: int | None = None,
                    memory_limit: float | None = None, fix: dict | None = None,
                    optimizer: Callable | None = None,
                    loss_fn: Callable | None = None, weights: str | None = None,
                    seed: int = 0, sequence_dim: int | None = 1) -> ParallelModel:
    """Plan `model` for `gpus` devices (memory_limit: GiB per device, as for `plan`). Outside a
    distributed launch this only plans; inside one (world size must equal gpus) rank 0's plan is
    shared so every rank shards the same way. weights: a Hugging Face checkpoint directory each
    rank reads its own slices of (planner.weights.hf_weights); a model on the meta device without weights
    is initialised per shard by planner.weights.materialize's plan-independent rule from `seed`.
    sequence_dim: as for `plan` (None: the inputs are not sequences)."""
    gpus = _check_gpus(gpus)
    model = with_loss(model, loss_fn)
    if dist.is_initialized() and dist.get_world_size() != gpus:
        raise RuntimeError(f"autoparallelize(gpus={gpus}) inside a launch of "
                           f"{dist.get_world_size()} processes: they must match")
    plans = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        plans = plan(model, gpus, example_inputs, cluster=cluster, global_batch=global_batch,
                     memory_limit=memory_limit, fix=fix, sequence_dim=sequence_dim)
    if dist.is_initialized():
        box = [[p.dumps() for p in plans] if plans else None]
        dist.broadcast_object_list(box, src=0)
        plans = [Plan.from_json(text) for text in box[0]]
    module = model if isinstance(model, torch.nn.Module) else None
    return ParallelModel(module, plans[0], plans[1:], example_inputs, optimizer, weights, seed)


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy to train in one process beside the parallel run."""
    return copy.deepcopy(model)
