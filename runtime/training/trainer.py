"""One training iteration on this rank: micro-batches through the pipeline schedule, data-parallel
gradient all-reduce overlapped with the rest of the backward, optional loss scaling and gradient
clipping, the optimizer step, and the loss made known to every rank."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from runtime.launch import activity
from runtime.training import rng
from runtime.training.batch import BatchSpec, compare_batches
from runtime.programs.token_split import holds_sequence, shard_sequence
from runtime.pipeline.executor import StageExecutor, explained, wait_or_explain
from runtime.pipeline.split_backward import SPLIT_BACKWARDS
from runtime.training.loss_tokens import StepTokens
from runtime.training.main_weights import compute_inputs, step_on_main
from runtime.experts.dispatch import ExpertGroups, broadcast_experts, is_expert
from runtime.training.activation_memory import SavedActivations
from runtime.comm.mesh import RankGroups
from runtime.data_parallel.replicas import broadcast_replicas
from runtime.data_parallel.grad_views import attach_views, flat_views, move_into_view, release
from runtime.pipeline.schedule import Kind, Schedule
from runtime.programs.shards import shard_specs
from runtime.data_parallel.sharded_dp import ShardedDP, ShardingSpec
from runtime.pipeline.simulator import Timeline
from runtime.programs.stage import StageProgram
from runtime.training.tied import broadcast_tied, sum_tied_grads, tie

# Each precision's autocast dtype; "bf16-main" runs in bf16 itself (runtime.training.main_weights).
_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-main": None}
# DistributedDataParallel's bucket sizes (its first bucket and bucket_cap_mb), used when
# TrainOptions.bucket_bytes is None.
_FIRST_BUCKET, _BUCKET = 2**20, 25 * 2**20


@dataclass(frozen=True)
class TrainOptions:
    """max_norm: clip the global gradient norm (of the whole model, across tp, pp and dp) to this.
    precision: "auto" (the default): "bf16-main" for a model whose weights are bf16, "fp32"
    otherwise; "fp32"; "bf16-main", bf16 weights, gradients and activations with fp32 main weights
    in the optimizer (runtime.training.main_weights: the model must be bf16, build_trainer casts
    it); or autocast mixed precision "bf16" / "fp16" (fp32 weights and optimizer; fp16 adds a
    dynamic loss scale: a step with an inf/nan gradient on any rank is skipped on all ranks and
    the scale halves; it doubles after `growth_interval` good steps).
    bucket_bytes: the most bytes of one data-parallel all-reduce bucket (level 0); None:
    DistributedDataParallel's defaults, 1 MiB for a stage's first bucket, 25 MiB for the others.
    track_memory: measure saved-activation bytes per stage (runtime.training.activation_memory; slows the forward).
    recv_ahead: receives posted ahead of need (runtime.pipeline.executor.StageExecutor).
    split_backward: how ZB-H1's W gets its weight gradients (runtime.pipeline.split_backward):
    "retraverse" (a backward from the stage's outputs again, I + W about 1.5 B) or "record"
    (from gradients I records: no second pass, more memory until W; a stage with recomputed
    layers retraverses all the same); "auto" (the default): what the plan priced
    (Plan.split_backward, planner.api.build_trainer), "retraverse" without a plan.
    zero: sharded data parallel level 0-3, dp_shard: ranks per shard group for hybrid sharding
    (runtime.data_parallel.sharded_dp)."""

    max_norm: float | None = None
    precision: str = "auto"
    bucket_bytes: int | None = None
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    track_memory: bool = False
    recv_ahead: int = 2
    split_backward: str = "auto"
    zero: int = 0
    dp_shard: int | None = None

    def __post_init__(self):
        ShardingSpec(self.zero, self.dp_shard)  # checks both
        if self.precision not in ("auto", *_PRECISIONS):
            raise ValueError(f"precision must be auto or one of {sorted(_PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {self.max_norm!r}")
        if (self.bucket_bytes is not None and self.bucket_bytes < 1) or self.init_scale <= 0 \
                or self.growth_interval < 1:
            raise ValueError("bucket_bytes, init_scale and growth_interval must be positive")
        if self.recv_ahead < 0:
            raise ValueError(f"recv_ahead must be >= 0, got {self.recv_ahead}")
        if self.split_backward not in ("auto", *SPLIT_BACKWARDS):
            raise ValueError(f"split_backward must be auto or one of {', '.join(SPLIT_BACKWARDS)}, "
                             f"got {self.split_backward!r}")


def auto_precision(params: Sequence[torch.nn.Parameter]) -> str:
    """TrainOptions.precision "auto": bf16 weights are trained with fp32 main weights
    ("bf16-main", what plans price for a 16-bit model), any other as they are ("fp32")."""
    return "bf16-main" if any(p.dtype == torch.bfloat16 for p in params) else "fp32"


def split_batch(batch: Sequence[torch.Tensor], names: Sequence[str], dp: int, dp_index: int,
                microbatches: int, cp: int = 1, cp_index: int = 0) -> list[dict[str, torch.Tensor]]:
    """This rank's share of the global batch, cut into equal micro-batches: rows of its
    data-parallel index and, under context parallelism, the tokens of its cp index (the zig-zag
    layout of runtime.programs.token_split, on dim 1 of each input that holds_sequence)."""
    size = batch[0].shape[0]
    if size % (dp * microbatches):
        raise ValueError(f"global batch {size} is not divisible by dp={dp} x "
                         f"micro-batches={microbatches}")
    local = [t.chunk(dp)[dp_index] for t in batch]
    if cp > 1:
        seq = next((t.shape[1] for t in local if t.dim() >= 2), None)
        local = [shard_sequence(t, cp, cp_index) if holds_sequence(t, seq) else t
                 for t in local]
    return [dict(zip(names, parts)) for parts in zip(*(t.chunk(microbatches) for t in local))]


def every_replica(batch: Sequence[torch.Tensor], names: Sequence[str], mesh,
                  microbatches: int) -> Callable[[], list[list[dict[str, torch.Tensor]]]]:
    """Every replica's micro-batches (split_batch's, dp index outer, cp inner), on demand, for a
    rank that holds the whole global batch (compare_batches checked it) to count every
    replica's targets itself."""
    return lambda: [split_batch(batch, names, mesh.dp, d, microbatches, mesh.cp, c)
                    for d in range(mesh.dp) for c in range(mesh.cp)]


class _Bucket:
    """Parameters whose gradients are views into one flat tensor, all-reduced in one call."""

    def __init__(self, params: list[torch.nn.Parameter], stage: int):
        self.params, self.stage = params, stage
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                device=params[0].device)
        self.views = flat_views(self.flat, params)
        self.ready = 0         # parameters whose gradient of this step is complete
        self.complete = False  # every gradient in: the all-reduce may start
        self.launched = False

    def zero(self, attach: bool = True) -> None:
        """Zero the gradients and (re)attach the views, should anything have replaced them;
        without `attach`, leave every gradient None for autograd to create (attach_one)."""
        self.ready, self.complete, self.launched = 0, False, False
        if not attach:
            release(self.params)
            return
        self.flat.zero_()
        attach_views(self.params, self.views)

    def attach_one(self, index: int) -> None:
        """Parameter `index`'s gradient, which autograd created, moved into its view."""
        move_into_view(self.params[index], self.views[index])

    def attach(self) -> None:
        """Every gradient in its view (zero for a parameter that got none this step)."""
        for p, view in zip(self.params, self.views):
            move_into_view(p, view)


class _GradSync:
    """Data-parallel gradient sum in buckets (parameters in reverse order, as backward roughly
    finishes them), each all-reduced asynchronously as soon as its gradients of the step are
    complete, as DistributedDataParallel does, and waited for only before the optimizer step.

    `grad_actions` (stage -> gradient-producing actions B or W of one step on this rank, in the
    order the stages' last such actions run) turns on the early start: a post-accumulate-grad
    hook counts each parameter's accumulations, and a bucket is complete when all of its
    parameters have had one per action, i.e. during the backward of the stage's last
    micro-batch. A parameter that gets no gradient in some action (unused) never completes its
    bucket that way; `start(stage)`, called when the stage's last action is done, completes the
    stage's buckets whatever their count. Buckets start strictly in one order (stages by their
    last action, then bucket order), the same on every replica, so the replicas' collectives
    pair up even if autograd finished the buckets in another order. A parameter read by several
    stages of this rank belongs to the one that finishes last. Without `grad_actions` the
    buckets start at `start(stage)` only."""

    def __init__(self, params: dict[int, list], group, bucket_bytes: int | None, rank: int,
                 grad_actions: dict[int, int] | None = None):
        self.group, self.rank = group, rank
        order = list(grad_actions) if grad_actions is not None else []
        order += [s for s in params if s not in order]
        owner = {}  # id -> the stage finishing last among those reading the parameter
        for stage in order:
            for p in params.get(stage, []):
                owner[id(p)] = stage
        self.buckets = {stage: self._split([p for p in params.get(stage, [])
                                            if owner[id(p)] == stage], bucket_bytes, stage)
                        for stage in order}
        self._order = [b for stage in order for b in self.buckets[stage]]
        self._next = 0  # position in _order of the next bucket to start
        self._pending: list[tuple] = []
        self._bucket_of = {id(p): (b, i) for b in self._order for i, p in enumerate(b.params)}
        self._expected: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        if grad_actions is not None and group is not None:
            for stage, ps in params.items():
                for p in ps:
                    self._expected[id(p)] = self._expected.get(id(p), 0) + \
                        grad_actions.get(stage, 0)
            for b in self._order:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._accumulated)

    @staticmethod
    def _split(params: list, limit: int | None, stage: int) -> list[_Bucket]:
        """Buckets of at most `limit` bytes (TrainOptions.bucket_bytes); None: DDP's defaults,
        a first bucket of 1 MiB (its all-reduce starts early in the backward), then 25 MiB."""
        buckets, current, size = [], [], 0
        for p in reversed(params):  # roughly the order backward finishes them
            nbytes = p.numel() * p.element_size()
            cap = limit or (_FIRST_BUCKET if not buckets else _BUCKET)
            if current and (size + nbytes > cap or p.dtype != current[0].dtype):
                buckets.append(_Bucket(current, stage))
                current, size = [], 0
            current.append(p)
            size += nbytes
        return buckets + ([_Bucket(current, stage)] if current else [])

    def zero(self) -> None:
        # With the hooks, autograd creates each gradient and the hook moves it into the bucket
        # (as DistributedDataParallel copies them in): cheaper than zeroing and adding.
        for bucket in self._order:
            bucket.zero(attach=not self._expected)
        self._next = 0
        self._seen.clear()

    def _accumulated(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: one more gradient of `param` added into its bucket."""
        key = id(param)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        bucket, index = self._bucket_of[key]
        if bucket.launched:
            raise RuntimeError(f"rank {self.rank}: a gradient of stage {bucket.stage} was added "
                               f"after its data-parallel all-reduce started ({seen} "
                               f"accumulations of a parameter, {self._expected[key]} expected)")
        if seen == 1:
            bucket.attach_one(index)
        if seen == self._expected[key]:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.complete = True
                self._launch()

    def start(self, stage: int) -> None:
        """The stage's backward is complete: start whatever of its buckets has not started."""
        activity.now(f"data-parallel all-reduce of stage {stage}")
        for bucket in self.buckets.get(stage, []):
            bucket.complete = True
        self._launch()

    def _launch(self) -> None:
        """Start the complete buckets at the head of the order."""
        while self._next < len(self._order) and self._order[self._next].complete:
            bucket = self._order[self._next]
            if self._expected:
                bucket.attach()  # gradients a hook has not moved in: none this step
            bucket.launched = True
            self._next += 1
            if self.group is None:
                continue
            what = (f"rank {self.rank} waiting for the data-parallel gradient all-reduce of "
                    f"stage {bucket.stage}")
            with explained(what):  # started inside backward too: a dead peer says so
                work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            self._pending.append((work, what))

    def wait(self) -> None:
        for work, what in self._pending:
            wait_or_explain([work], what)
        self._pending.clear()


@dataclass
class _LossScale:
    """Dynamic loss scale for fp16; every rank updates it from the same all-reduced flag."""

    scale: float
    growth_interval: int
    good_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale, self.good_steps = self.scale / 2, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2, 0


class PipelineTrainer:
    """`step(*global_batch)` trains one iteration and returns the loss (the same on every rank).
    After a step: `grad_norm` (before clipping; None unless max_norm or fp16), `skipped` (fp16
    overflow), `loss_scale`, `timeline()` and, with track_memory, `memory`.

    `tied`: groups of names of one parameter used in several places (Captured.tied); they stay
    one parameter (runtime.training.tied). At set-up every replica takes the first replica's weights
    (runtime.data_parallel.replicas), so the run does not depend on every rank having built the same model."""

    def __init__(self, programs: dict[int, StageProgram], schedule: Schedule, groups: RankGroups,
                 input_names: Sequence[str],
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 options: TrainOptions = TrainOptions(), tied: tuple[tuple[str, ...], ...] = (),
                 batch: BatchSpec | None = None, experts: ExpertGroups | None = None):
        self.programs, self.schedule, self.groups = programs, schedule, groups
        self.input_names = tuple(input_names)
        self.batch_spec = batch
        self.tied = tie(programs, tied, groups)
        unique = {id(p): p for prog in programs.values() for p in prog.gm.parameters()}
        self.params = [p for p in unique.values() if p.requires_grad]
        self.options = replace(options, precision=auto_precision(self.params)) \
            if options.precision == "auto" else options
        self._sharded = self._sharded_params()
        # Expert weights (runtime.experts.dispatch) are replicated over the ranks holding the same experts.
        self.experts = experts
        broadcast_replicas([p for p in unique.values() if not is_expert(p)], self._sharded, groups)
        broadcast_experts([p for p in unique.values() if is_expert(p)], groups, experts)
        broadcast_tied(self.tied)
        rng.seed_ranks(rng.shared_seed(), groups.tp_index, groups.pp_index, groups.dp_index,
                       groups.cp_index)  # dropout streams per rank (runtime.training.rng)
        self._not_in_norm = {id(c.param) for c in self.tied if not c.counts_in_norm}
        self.sharded = self._sharding(programs, options)
        # Expert weights stay out of sharded data parallel: they are replicated over fewer ranks.
        self._experts = [p for p in self.params if is_expert(p)]
        self.optimizer = optimizer(self.sharded.optimizer_params() + self._experts
                                   if self.sharded else self.params)
        self.memory = (SavedActivations(prog.gm for prog in programs.values())
                       if options.track_memory else None)
        stage_rank = lambda stage: groups.stage_rank(schedule.stage_to_rank(stage))  # noqa: E731
        self.executor = StageExecutor(programs, schedule, groups.rank, stage_rank,
                                      autocast_dtype=_PRECISIONS[self.options.precision],
                                      memory=self.memory, recv_ahead=options.recv_ahead,
                                      split_backward="retraverse"
                                      if options.split_backward == "auto"
                                      else options.split_backward)
        self.last_rank = stage_rank(schedule.num_stages - 1)
        # Ranks holding the same weights (dp x cp) average their gradients.
        dense = {s: [p for p in ps if not is_expert(p)] for s, ps in self.executor.params.items()}
        self.sync = (_GradSync(dense, groups.replicas, options.bucket_bytes, groups.rank,
                               self._grad_actions()) if groups.replicas is not None and
                     self.sharded is None else None)
        self.executor.sharding = self.sharded
        self.tokens = StepTokens(programs, tuple(c for prog in programs.values()
                                                 for c in prog.loss_counts),
                                 groups.replicas, groups.num_replicas)
        self.expert_sync = self._expert_sync(options)
        self.scaler = (_LossScale(options.init_scale, options.growth_interval)
                       if self.options.precision == "fp16" else None)
        self.grad_norm: float | None = None
        self.skipped = False

    def _sharding(self, programs, options: TrainOptions) -> ShardedDP | None:
        """Sharded data parallel for zero >= 1; tied and shared parameters stay whole."""
        if options.zero == 0:
            ShardingSpec(0, options.dp_shard).shard_size(self.groups.mesh.dp)
            return None
        whole = {id(c.param) for c in self.tied}
        by_stage = {s: [p for p in prog.gm.parameters() if p.requires_grad and not is_expert(p)]
                    for s, prog in programs.items()}
        return ShardedDP(programs, by_stage, self.groups,
                         ShardingSpec(options.zero, options.dp_shard), self._sharded, whole,
                         self._grad_actions())

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def step(self, *batch: torch.Tensor) -> float:
        activity.start_step(self)
        if self.batch_spec is not None:  # before any collective: a refused step leaves none
            self.batch_spec.check(batch)      # half-done for the next step to pair with
            activity.now("comparing the ranks' batches")
            compare_batches(batch)
        mesh = self.groups.mesh
        micro = self.local_microbatches(batch, self.schedule.num_microbatches)
        if self.sharded is not None:
            self.sharded.zero()
            self.expert_sync.zero()
        elif self.sync is not None:
            self.sync.zero()
            self.expert_sync.zero()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        # A mean loss's count of the step's targets; once the ranks are known to hold the same
        # global batch, each can count every replica's share itself.
        checked = self.batch_spec is not None
        self.tokens.before_step(micro, every_replica(batch, self.input_names, mesh,
                                                     self.schedule.num_microbatches)
                                if checked else None)
        pending_loss = self._await_loss()
        # The mean over replicas is folded into the loss, so the all-reduce is a plain sum.
        multiplier = self.loss_scale / (len(micro) * self.groups.num_replicas)
        done = self._sharded_done if self.sharded else self._start_sync if self.sync else None
        loss = self.executor.run(micro, multiplier, done)
        loss_sum = self._start_loss_sum(loss, pending_loss)
        if self.sharded is not None:
            activity.now("waiting for the sharded data-parallel reduce-scatter")
            self.sharded.wait()
            self.expert_sync.wait()
        if self.sync is not None:
            activity.now("waiting for the data-parallel gradient all-reduce")
            self.sync.wait()
            self.expert_sync.wait()
        sum_tied_grads(self.tied)
        self.skipped = self._unscale_and_clip()
        if not self.skipped:
            activity.now("optimizer step")
            if self.options.precision == "bf16-main":
                step_on_main(self.optimizer)
            else:
                self.optimizer.step()
            if self.sharded is not None:
                activity.now("sharded data-parallel all-gather of the parameters")
                self.sharded.after_step()
        activity.now("loss broadcast")
        return self._share_loss(pending_loss, loss_sum)

    def local_microbatches(self, batch, microbatches: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of a global batch (split_batch), floating inputs in bf16
        under precision "bf16-main"."""
        if self.options.precision == "bf16-main":
            batch = compute_inputs(batch)
        mesh = self.groups.mesh
        return split_batch(batch, self.input_names, mesh.dp, self.groups.dp_index,
                           microbatches, mesh.cp, self.groups.cp_index)

    def _grad_actions(self) -> dict[int, int]:
        """Per stage of this rank, its gradient-producing actions (B or W) in one step, in the
        order the stages' last such actions run (runtime.training.trainer._GradSync)."""
        actions = self.schedule.actions[self.schedule.stage_to_rank(min(self.programs))]
        kinds = (Kind.B, Kind.W)
        last = {a.stage: i for i, a in enumerate(actions) if a.kind in kinds}
        counts = Counter(a.stage for a in actions if a.kind in kinds)
        return {stage: counts[stage] for stage in sorted(last, key=last.get)}

    def _expert_sync(self, options: TrainOptions) -> "_GradSync":
        """Expert gradients are summed over the ranks holding the same experts only (each one
        already holds every EP rank's tokens' part, through the dispatch's backward); with one
        such rank per expert the sync has no buckets and only zeroes their gradients."""
        params = {s: [p for p in ps if is_expert(p)] for s, ps in self.executor.params.items()}
        group = self.experts.replicas if self.experts is not None else None
        unsynced = [p for ps in params.values() for p in ps] if group is None else []
        sync = _GradSync(params if group is not None else {s: [] for s in params}, group,
                         options.bucket_bytes, self.groups.rank)
        zero = sync.zero
        sync.zero = lambda: (zero(), [setattr(p, "grad", None) for p in unsynced])
        return sync

    def _sharded_done(self, stage: int) -> None:
        self.sharded.stage_done(stage)
        if self.expert_sync.group is not None:
            self.expert_sync.start(stage)

    def _start_sync(self, stage: int) -> None:
        self.sync.start(stage)
        if self.expert_sync.group is not None:
            self.expert_sync.start(stage)

    def timeline(self) -> Timeline:
        """This rank's measured compute actions of the last step (rank = pipeline index)."""
        return self.executor.timeline()

    # -- loss scale and gradient clipping ---------------------------------------------------------
    def _sharded_params(self) -> set[int]:
        """ids of tensor-parallel shards: their squares are summed across tp; the other
        parameters are replicated across tp and counted on tp index 0 only."""
        named = {name: p for prog in self.programs.values() for name, p in
                 prog.gm.named_parameters()}
        return {id(named[name]) for prog in self.programs.values()
                for name in shard_specs(prog.gm) if name in named}

    def _unscale_and_clip(self) -> bool:
        """Returns True when the step must be skipped (fp16 overflow on any rank)."""
        self.grad_norm = None
        if self.options.max_norm is None and self.scaler is None:
            return False
        used_scale = self.loss_scale  # the scale this step's backward ran with
        params = self.sharded.whole + self._experts if self.sharded else self.params
        with_grad = [p for p in params if p.grad is not None]
        grads = [p.grad for p in with_grad] + (self.sharded.shard_grads() if self.sharded else [])
        norm_sq, found_inf = self._global_norm_sq(with_grad)
        if self.scaler is not None:
            self.scaler.update(found_inf)
            if found_inf:
                return True
        self.grad_norm = math.sqrt(norm_sq) / used_scale
        # Unscaling and clipping in one pass; clip as torch.nn.utils.clip_grad_norm_ does.
        coef = 1.0 / used_scale
        if self.options.max_norm is not None:
            coef *= min(1.0, self.options.max_norm / (self.grad_norm + 1e-6))
        if coef != 1.0:
            for g in grads:
                g.mul_(coef)
        return False

    def _global_norm_sq(self, params: list[torch.nn.Parameter]) -> tuple[float, bool]:
        """Sum of squares of the whole model's gradient, and whether any rank saw inf/nan; one
        all-reduce over all ranks. Each value is counted once: dp x cp replicas only on index 0,
        replicated (non-sharded) parameters only on tp index 0."""
        counted = [p for p in params if id(p) not in self._not_in_norm]  # tied: once
        sharded = [p.grad for p in counted if id(p) in self._sharded]
        replicated = [p.grad for p in counted if id(p) not in self._sharded and not is_expert(p)]
        experts = [p.grad for p in counted if is_expert(p)]  # whole over tp, once per EP group
        local = [_sq(sharded), _sq(replicated), _sq(experts)]
        counted = local[0] + (local[1] if self.groups.tp_index == 0 else 0.0)
        first_replica = self.groups.dp_index == 0 and self.groups.cp_index == 0
        in_first = self.experts is None or self.experts.first_replica
        counted_experts = local[2] if in_first and self.groups.tp_index == 0 else 0.0
        shards = self.sharded.norm_sq(self.groups.tp_index) if self.sharded else 0.0
        if self.sharded is not None:  # every shard's squares, finite or not on any rank
            local.append(_sq(self.sharded.shard_grads()))
        values = torch.tensor([(counted if first_replica else 0.0) + shards + counted_experts,
                               0.0 if math.isfinite(sum(local)) else 1.0],
                              dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            activity.now("gradient-norm all-reduce")
            work = dist.all_reduce(values, async_op=True)
            wait_or_explain([work], f"rank {self.groups.rank} waiting for the gradient-norm "
                                    f"all-reduce")
        return float(values[0]), bool(values[1] > 0)

    def _await_loss(self):
        """Ranks without the last stage post their side of the loss broadcast as the step
        starts, so no rank waits at the end of the step for the one that finishes last."""
        if self.groups.pp is None or self.groups.rank == self.last_rank:
            return None
        value = torch.zeros((), dtype=torch.float32)  # as _start_loss_sum sends it, whatever
        # the default dtype (a float64 default read the sender's bytes as another number)
        work = dist.broadcast(value, src=self.last_rank, group=self.groups.pp, async_op=True)
        return value, work

    def _start_loss_sum(self, loss: torch.Tensor | None, pending):
        """On the ranks holding the last stage: the loss's sum over the replicas, started as
        the schedule ends, behind the gradient collectives on the same group, so that it is
        done by the end of the optimizer step. (value, work or None); None elsewhere."""
        if pending is not None:
            return None
        value = loss.detach().clone().float()
        work = (dist.all_reduce(value, group=self.groups.replicas, async_op=True)
                if self.groups.replicas is not None else None)
        return value, work

    def _share_loss(self, pending, loss_sum) -> float:
        if pending is not None:
            value, work = pending
            wait_or_explain([work], f"rank {self.groups.rank} waiting for the loss from rank "
                                    f"{self.last_rank}")
            return float(value)
        value, work = loss_sum
        if work is not None:
            wait_or_explain([work], f"rank {self.groups.rank} waiting for the loss all-reduce "
                                    f"over the replicas")
            value /= self.groups.num_replicas
        if self.groups.pp is not None:
            dist.broadcast(value, src=self.last_rank, group=self.groups.pp)
        return float(value)


def _sq(grads: list[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, foreach=False).double() ** 2)
