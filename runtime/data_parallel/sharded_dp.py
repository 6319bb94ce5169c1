"""Sharded data parallel (ZeRO stages 1-3, FSDP) over flat buckets, with hybrid sharding.

Levels (Rajbhandari et al. 2020; the names torchtitan and Megatron-Core use in brackets):

  0  replicated: whole gradients all-reduced (runtime.training.trainer._GradSync, not this module)
  1  optimizer states sharded [Megatron's distributed optimizer]: gradients accumulate whole over
     the step's micro-batches; each unit's gradients are reduce-scattered as soon as the last
     micro-batch's backward has produced them (post-accumulate-grad hooks count one accumulation
     per gradient-producing action of the stage, as runtime.training.trainer._GradSync does for
     level 0; whatever is left starts when the stage's backward is complete), all of them in
     flight together, each rank steps its shard, and the parameters are all-gathered back
  2  plus gradients sharded: each unit's gradients are reduce-scattered as soon as one
     micro-batch's backward has produced them (a post-accumulate-grad hook), overlapping the rest
     of the backward, and accumulated into the shard; the whole gradient lives for one
     micro-batch's backward of one unit only
  3  plus parameters sharded [FSDP, ZeRO-3]: a unit's parameters are all-gathered just before
     its forward and freed right after it (the storage is resized to 0, as FSDP does); the
     backward gathers them again when autograd unpacks a saved parameter, and frees them once the
     unit's gradients are reduce-scattered (or when the compute action ends: an input-gradient
     step I of ZB-H1 produces no weight gradients). Parameters are re-gathered per micro-batch,
     for every F and every backward action (B, or I and W) that reads them. The gather of the
     next unit in forward order is started when a unit is gathered (prefetch), in backward the
     previous unit's.

A unit is one layer of one stage program (node.meta["fxpar_layer"]); a bucket is one unit's
parameters of one dtype, tensor-parallel shards apart from replicated ones (the gradient norm
counts them differently). Each bucket is one flat tensor padded to a multiple of the shard group
so that `reduce_scatter_tensor` / `all_gather_into_tensor` take equal pieces (gloo refuses uneven
ones). Parameters are views into it; the optimizer is an ordinary torch.optim optimizer over one
flat shard Parameter per bucket (`ShardedDP.optimizer_params`), and `slices()` says, per full
parameter name, which range of it this rank holds (for sharded checkpoints).

Parameters several layers read (tied or shared weights, StageProgram.shared_params) stay whole
and replicated (level 0 within this module: all-reduced over the replicas).

Hybrid sharding (HSDP): the dp x cp replicas of a stage are cut into groups of `dp_shard x cp`
consecutive ranks that shard; gradient shards are then all-reduced over the `dp / dp_shard`
groups' corresponding ranks (the replicate group).

Why not torch's fully_shard (FSDP2): it hooks nn.Module forwards, while a stage program is an FX
GraphModule whose rewritten layers read parameters through get_attr nodes (no module call to
hook), and ZB-H1 splits one backward into I and W calls that FSDP2's post-backward hook pairs as
one; flat buckets with explicit collectives run unchanged under every schedule and mesh. The
level-3 edits of a stage program (gather and free calls) are runtime.data_parallel.zero3_graph's.
"""
from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from runtime.comm import collectives
from runtime.comm.mesh import RankGroups, per_world
from runtime.data_parallel.grad_views import attach_views, flat_views, move_into_view, release
from runtime.data_parallel.zero3_graph import (insert_gathers, param_units, regather_recomputed, register,
                                 unit_order)
from runtime.programs.saved import without_graph

LEVELS = (0, 1, 2, 3)
# torch 2.13 renames the tensor collectives (*_single), deprecating the old; 2.11 has the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ShardingSpec:
    """level: 0-3 (module docstring). dp_shard: data-parallel ranks per shard group (hybrid
    sharding: shard within, replicate across); None shards over the whole dp axis."""

    level: int = 0
    dp_shard: int | None = None

    def __post_init__(self):
        if self.level not in LEVELS or isinstance(self.level, bool):
            raise ValueError(f"zero level must be one of {LEVELS}, got {self.level!r}")
        if self.dp_shard is not None and (isinstance(self.dp_shard, bool) or not
                                          isinstance(self.dp_shard, int) or self.dp_shard < 1):
            raise ValueError(f"dp_shard must be a positive integer, got {self.dp_shard!r}")

    def shard_size(self, dp: int) -> int:
        """Data-parallel ranks per shard group for a data-parallel size `dp`."""
        size = dp if self.dp_shard is None else self.dp_shard
        if dp % size:
            raise ValueError(f"dp_shard={size} does not divide dp={dp}; choose a divisor of dp")
        if self.level == 0 and size != dp:
            raise ValueError(f"dp_shard={size} needs a zero level of 1, 2 or 3 (got zero=0)")
        return size


@dataclass(frozen=True)
class ShardSlice:
    """Where one full parameter lies in this rank's shard: elements [start, stop) of the
    flattened parameter are elements [local_start, local_start + stop - start) of `shard`."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    local_start: int
    bucket: int


# -- groups -------------------------------------------------------------------------------------
_GROUPS: dict[tuple, tuple] = {}


def shard_groups(groups: RankGroups, dp_shard: int):
    """(shard group, index in it, size, replicate group, index in it) of this rank; collective
    on first use for a mesh (every rank creates every group, in one order)."""
    mesh = groups.mesh

    def make():
        size = dp_shard * mesh.cp
        found = (None, 0, 1, None, 0)
        for ranks in mesh.groups(("dp", "cp")):
            chunks = [ranks[i:i + size] for i in range(0, len(ranks), size)]
            mine_s = _new_groups(chunks, groups.rank)
            mine_r = _new_groups([list(c) for c in zip(*chunks)], groups.rank)
            if groups.rank in ranks:
                chunk = next(c for c in chunks if groups.rank in c)
                column = [c[chunk.index(groups.rank)] for c in chunks]
                found = (mine_s, chunk.index(groups.rank), size, mine_r,
                         column.index(groups.rank))
        return found
    return per_world(_GROUPS, (mesh, dp_shard), make)


def _new_groups(rank_lists, me):
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if me in ranks:
            mine = group
    return mine


# -- traffic ------------------------------------------------------------------------------------
TRAFFIC: dict[str, float] = defaultdict(float)
"""Bytes this rank sends per collective kind ("all_gather", "reduce_scatter", "all_reduce"), ring
formula: (n-1)/n of the full buffer for all-gather and reduce-scatter, 2(n-1)/n for all-reduce."""
CALLS: dict[str, int] = defaultdict(int)


def _count(kind: str, nbytes: int, n: int) -> None:
    factor = 2 if kind == "all_reduce" else 1
    TRAFFIC[kind] += factor * (n - 1) / n * nbytes
    CALLS[kind] += 1


# -- buckets ------------------------------------------------------------------------------------
class _Bucket:
    """One unit's parameters of one kind as views into one padded flat tensor."""

    def __init__(self, index: int, unit: str, names, params, shard_rank: int, n: int,
                 level: int, tp_sharded: bool):
        self.index, self.unit, self.names, self.params = index, unit, names, params
        self.level, self.n, self.tp_sharded = level, n, tp_sharded
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        self.shard_len = -(-total // n)
        self.padded = self.shard_len * n
        self.lo = shard_rank * self.shard_len
        self.full = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            offset = 0
            for p, k in zip(params, self.numels):
                self.full[offset:offset + k].copy_(p.detach().reshape(-1))
                p.data = self.full[offset:offset + k].view_as(p)
                offset += k
        piece = self.full[self.lo:self.lo + self.shard_len]
        # Levels 1-2 keep the parameters whole: the shard is a view of them. Level 3 frees the
        # whole buffer between uses, so the shard is a tensor of its own.
        self.shard = torch.nn.Parameter(piece.clone() if level == 3 else piece)
        # Level 1 accumulates whole gradients in one flat buffer (autograd adds into views of
        # it) and its shard's gradient is a view of that buffer; levels 2-3 keep the shard only.
        self.grad_full = torch.zeros_like(self.full) if level == 1 else None
        self.shard.grad = (self.grad_full[self.lo:self.lo + self.shard_len] if level == 1
                           else torch.zeros_like(self.shard))
        self.grad_views = []  # level 1: each parameter's gradient as a view of grad_full
        if level == 1:
            self.grad_views = flat_views(self.grad_full, params)
        self.gathered = True
        self.pending = None    # an async all-gather into full
        self.accumulated = 0   # gradients accumulated since the last reduce-scatter
        self.inflight = None   # (work, buffer) of an async reduce-scatter
        self.ready = 0         # level 1: parameters whose gradient of the step is complete
        self.reduced = False   # level 1: this step's reduce-scatter has started

    @property
    def nbytes(self) -> int:
        return self.padded * self.full.element_size()

    # parameters (level 3)
    def free(self) -> None:
        if self.pending is not None:  # a prefetch: its storage is allocated too
            self.pending.wait()
            self.pending = None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def start_gather(self, group) -> None:
        if self.gathered or self.pending is not None:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        if group is None:  # a shard group of one rank holds everything
            with torch.no_grad():
                self.full.copy_(self.shard)
            self.gathered = True
            return
        _count("all_gather", self.nbytes, self.n)
        self.pending = _all_gather(self.full, self.shard.detach(), group=group, async_op=True)

    def gather(self, group) -> None:
        self.start_gather(group)
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.gathered = True

    # gradients
    def flat_grad(self) -> torch.Tensor:
        """The parameters' gradients as one padded flat tensor; the gradients are released."""
        flat = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
        offset = 0
        for p, k in zip(self.params, self.numels):
            if p.grad is not None:  # every element written once: no zeroing pass before
                flat[offset:offset + k].view_as(p).copy_(p.grad)
            else:
                flat[offset:offset + k].zero_()
            p.grad = None
            offset += k
        flat[offset:].zero_()  # the padding
        return flat

    def zero_grads(self, attach: bool = True) -> None:
        """Levels 2-3: the shard's gradient zeroed, the parameters' None. Level 1: the whole
        buffer zeroed and the parameters' gradients views of it; without `attach`, their
        gradients None for autograd to create and attach_one to move in (the padding zeroed)."""
        self.finish_reduce()
        self.accumulated = self.ready = 0
        self.reduced = False
        if self.grad_full is None:
            self.shard.grad.zero_()
            release(self.params)
        elif not attach:
            self.grad_full[sum(self.numels):].zero_()
            release(self.params)
        else:
            self.grad_full.zero_()
            attach_views(self.params, self.grad_views)

    def attach_one(self, index: int) -> None:
        """Level 1: parameter `index`'s gradient moved into its view of grad_full."""
        move_into_view(self.params[index], self.grad_views[index])

    def attach(self) -> None:
        for p, view in zip(self.params, self.grad_views):
            move_into_view(p, view)

    def reduce_scatter(self, group) -> None:
        """Reduce-scatter the gradients held now into the shard's gradient (asynchronously):
        level 1 from its flat buffer, levels 2-3 from a flat copy (the gradients released)."""
        self.finish_reduce()
        flat = self.grad_full if self.grad_full is not None else self.flat_grad()
        self.accumulated = 0
        if group is None:
            if self.grad_full is None:
                self.shard.grad.add_(flat[self.lo:self.lo + self.shard_len])
            return
        _count("reduce_scatter", self.nbytes, self.n)
        if self.grad_full is None and collectives.backend(group) == "gloo":
            # gloo's reduce_scatter_tensor all-reduces a clone of its input; levels 2-3 own
            # `flat`, so all-reduce it in place: the same sums and traffic, no clone.
            work = dist.all_reduce(flat, group=group, async_op=True)
            out = flat[self.lo:self.lo + self.shard_len]
        else:
            out = torch.empty(self.shard_len, dtype=flat.dtype, device=flat.device)
            work = _reduce_scatter(out, flat, group=group, async_op=True)
        self.inflight = (work, out, flat)

    def finish_reduce(self) -> None:
        if self.inflight is not None:
            work, out, flat = self.inflight
            work.wait()
            if self.grad_full is not None:
                self.shard.grad.copy_(out)
            else:
                self.shard.grad.add_(out)
                flat.untyped_storage().resize_(0)  # now: gloo's thread may still hold the work
            self.inflight = None


class ShardedDP:
    """Gradient reduction, sharded optimizer step and (level 3) parameter gathering for the stage
    programs of one rank. The trainer calls zero() at the start of a step, stage_done(stage) when
    a stage's backward is complete, wait() before the optimizer step and after_step() after it;
    the executor calls action_done() after each compute action and enters saving() around each
    forward."""

    _ids = itertools.count()

    def __init__(self, programs: dict, params_by_stage: dict[int, list], groups: RankGroups,
                 spec: ShardingSpec, sharded_ids: set[int], keep_whole: set[int],
                 grad_actions: dict[int, int] | None = None):
        self.spec, self.groups, self.level = spec, groups, spec.level
        dp_shard = spec.shard_size(groups.mesh.dp)
        (self.group, self.shard_rank, self.n, self.replicate,
         self.replicate_rank) = shard_groups(groups, dp_shard)
        self.key = f"zero{next(self._ids)}"
        self.buckets: list[_Bucket] = []
        self.by_stage: dict[int, list[_Bucket]] = defaultdict(list)
        self.whole: list[torch.nn.Parameter] = []   # replicated, all-reduced over the replicas
        self._by_param: dict[int, _Bucket] = {}
        self._index: dict[int, int] = {}  # parameter id -> its place in its bucket
        for stage, program in sorted(programs.items()):
            self._bucket_stage(stage, program.gm, params_by_stage[stage], sharded_ids,
                               keep_whole)
        self.units = {(b.unit, b.index): b for b in self.buckets}
        # Level 1 with grad_actions (stage -> its gradient-producing actions B or W in one
        # step): a parameter's gradient is complete after that many accumulations.
        self._expected: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        if self.level == 1 and grad_actions is not None and self.group is not None:
            for stage, buckets in self.by_stage.items():
                for p in (p for b in buckets for p in b.params):
                    self._expected[id(p)] = grad_actions.get(stage, 0)
        if self.level >= 2 or self._expected:
            for bucket in self.buckets:
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
        if self.level == 3:
            self._unit_order = {}
            for stage, program in programs.items():
                held = {b.unit.split(":", 1)[1] for b in self.by_stage.get(stage, [])}
                order = [u for u in unit_order(program.gm) if u in held]
                self._unit_order[stage] = order
                insert_gathers(program.gm, self.key, stage, order)
                regather_recomputed(program.gm, self.key, stage, set(order))
            register(self.key, self)
            for bucket in self.buckets:
                bucket.free()
        self.peak = {"params": 0, "grads": 0}
        self._inflight: _Bucket | None = None
        self._backward_unit: tuple[int, str] | None = None

    # -- set-up ---------------------------------------------------------------------------
    def _bucket_stage(self, stage, gm: fx.GraphModule, params, sharded_ids, keep_whole):
        owner = param_units(gm)
        names = {id(p): name for name, p in gm.named_parameters()}
        groups: dict[tuple, list] = defaultdict(list)
        for p in params:
            unit = owner.get(names.get(id(p)))
            if id(p) in keep_whole or unit is None:
                if id(p) not in {id(q) for q in self.whole}:
                    self.whole.append(p)
                continue
            groups[(unit, p.dtype, id(p) in sharded_ids)].append(p)
        for (unit, _, tp_sharded), ps in groups.items():
            bucket = _Bucket(len(self.buckets), f"{stage}:{unit}", [names[id(p)] for p in ps],
                             ps, self.shard_rank, self.n, self.level, tp_sharded)
            self.buckets.append(bucket)
            self.by_stage[stage].append(bucket)
            for i, p in enumerate(ps):
                self._by_param[id(p)] = bucket
                self._index[id(p)] = i

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: one flat shard per bucket, then the whole parameters."""
        return [b.shard for b in self.buckets] + self.whole

    def slices(self) -> dict[str, ShardSlice]:
        """Per full parameter name (as in the stage program), the range this rank holds."""
        out = {}
        for b in self.buckets:
            offset = 0
            for name, p, k in zip(b.names, b.params, b.numels):
                start, stop = max(offset, b.lo), min(offset + k, b.lo + b.shard_len)
                if start < stop:
                    out[name] = ShardSlice(name, tuple(p.shape), start - offset, stop - offset,
                                           start - b.lo, b.index)
                offset += k
        return out

    # -- the step ---------------------------------------------------------------------------
    def zero(self) -> None:
        for b in self.buckets:  # level 1 with hooks: autograd creates, the hook moves in
            b.zero_grads(attach=not self._expected)
        for p in self.whole:
            p.grad = None
        self._seen.clear()
        self.peak = {"params": self.param_bytes(), "grads": self.grad_bytes()}

    def _grad_ready(self, param) -> None:
        bucket = self._by_param[id(param)]
        if self.level == 1:
            self._level1_ready(bucket, id(param))
            return
        bucket.accumulated += 1
        self._note()
        if bucket.accumulated == len(bucket.params):
            self._reduce(bucket)
            if self.level == 3:
                bucket.free()

    def _level1_ready(self, bucket: _Bucket, key: int) -> None:
        """Level 1: one more accumulation of a parameter's gradient; a bucket whose parameters
        are all complete starts its reduce-scatter."""
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if bucket.reduced:
            raise RuntimeError(f"a gradient of {bucket.unit} was added after its reduce-scatter "
                               f"started ({seen} accumulations, {self._expected[key]} expected)")
        if seen == 1:
            bucket.attach_one(self._index[key])
        if seen == self._expected[key]:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._reduce(bucket)

    def stage_done(self, stage: int) -> None:
        for b in self.by_stage.get(stage, []):
            # level 1 reduces once (unless its hooks started it already); 2-3 flush leftovers
            if (self.level == 1 and not b.reduced) or (self.level > 1 and b.accumulated):
                self._note()
                self._reduce(b)

    def _reduce(self, bucket: _Bucket) -> None:
        """Levels 2-3: one reduce-scatter in flight at a time: its buffers are the only
        whole-sized gradient copies alive. Level 1 reduces from the whole gradient buffer that
        lives anyway, into a shard-sized one: all of them may be in flight together."""
        if self.level == 1:
            if self._expected:
                bucket.attach()  # gradients no hook moved in: none this step
            bucket.reduced = True
            bucket.reduce_scatter(self.group)
            return
        if self._inflight is not None and self._inflight is not bucket:
            self._inflight.finish_reduce()
        bucket.reduce_scatter(self.group)
        self._inflight = bucket

    def action_done(self, action) -> None:
        self._backward_unit = None
        if self.level == 3:
            for b in self.by_stage.get(action.stage, []):
                b.free()

    def wait(self) -> None:
        for b in self.buckets:
            b.finish_reduce()
            if self.replicate is not None:
                _count("all_reduce", b.shard_len * b.shard.element_size(),
                       dist.get_world_size(self.replicate))
                dist.all_reduce(b.shard.grad, group=self.groups_replicate())
        replicas = self.groups.replicas
        for p in self.whole:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if replicas is not None:
                dist.all_reduce(p.grad, group=replicas)
        self._note()

    def groups_replicate(self):
        return self.replicate

    def after_step(self) -> None:
        """Levels 1-2: all-gather the updated shards into the whole parameters."""
        if self.level in (1, 2) and self.group is not None:
            works = []
            for b in self.buckets:
                _count("all_gather", b.nbytes, self.n)
                sent = b.shard.detach().clone()
                works.append((_all_gather(b.full, sent, group=self.group, async_op=True), sent))
            for work, sent in works:
                work.wait()
                sent.untyped_storage().resize_(0)  # freed now, as in finish_reduce

    # -- level 3: gathering around uses ------------------------------------------------------
    def gather_unit(self, stage: int, unit: str, prefetch: int = 1) -> None:
        order = self._unit_order[stage]
        for b in self.by_stage[stage]:
            if b.unit == f"{stage}:{unit}":
                b.gather(self.group)
        i = order.index(unit) + prefetch
        if 0 <= i < len(order):
            for b in self.by_stage[stage]:
                if b.unit == f"{stage}:{order[i]}":
                    b.start_gather(self.group)
        self._note()

    def backward_gather(self, stage: int, unit: str) -> None:
        """Gather a unit the backward needs (a saved parameter unpacked, or a checkpointed
        region recomputed) and prefetch the one before it. The backward walks the units in
        reverse: the one it gathered before is done (were it not, it would be gathered again)."""
        if self._backward_unit not in (None, (stage, unit)):
            self.free_unit(*self._backward_unit)
        self._backward_unit = (stage, unit)
        self.gather_unit(stage, unit, prefetch=-1)

    def free_unit(self, stage: int, unit: str) -> None:
        for b in self.by_stage[stage]:
            if b.unit == f"{stage}:{unit}":
                b.free()

    def saving(self):
        """Saved-tensor hooks for a forward: a saved parameter of a level-3 unit is gathered
        again when the backward unpacks it."""
        if self.level != 3:
            return contextlib.nullcontext()
        def pack(t):
            # by storage, not address: a dry run's fake tensors have no address
            # (planner.bench.dry_run), and a storage is one Python object while it lives
            storage = t.untyped_storage()
            bucket = next((b for b in self.buckets if b.gathered and storage.nbytes()
                           and b.full.untyped_storage() is storage), None)
            return bucket, without_graph(t)

        def unpack(packed):
            bucket, t = packed
            if bucket is not None and not bucket.gathered:
                stage, unit = bucket.unit.split(":", 1)
                self.backward_gather(int(stage), unit)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def full_tensors(self, grads: bool = False):
        """Inside: every parameter whole (level 3 gathers), and with grads, each parameter's
        .grad the whole reduced gradient (all-gathered from the shards)."""
        for b in self.buckets:
            if self.level == 3:
                b.gather(self.group)
            if grads:
                full = torch.empty_like(b.full)
                if self.group is None:
                    full.copy_(b.shard.grad)
                else:
                    _all_gather(full, b.shard.grad.detach(), group=self.group)
                offset = 0
                for p, k in zip(b.params, b.numels):
                    p.grad = full[offset:offset + k].view_as(p)
                    offset += k
        try:
            yield
        finally:
            for b in self.buckets:
                if grads:
                    for p in b.params:
                        p.grad = None
                if self.level == 3:
                    b.free()

    # -- the norm and measurement ------------------------------------------------------------
    def norm_sq(self, tp_index: int) -> float:
        """This rank's share of the squared global gradient norm over the shards: every shard
        rank counts its own shard; the replicate group only on its index 0; tensor-parallel
        replicated buckets only on tp index 0."""
        if self.replicate_rank != 0:
            return 0.0
        total = 0.0
        for b in self.buckets:
            if b.tp_sharded or tp_index == 0:
                total += float(b.shard.grad.double().pow(2).sum())
        return total

    def shard_grads(self) -> list[torch.Tensor]:
        return [b.shard.grad for b in self.buckets]

    def param_bytes(self) -> int:
        """Bytes of parameters held now: whole buffers while gathered, separate shards."""
        held = sum(b.full.untyped_storage().nbytes() for b in self.buckets)
        if self.level == 3:
            held += sum(b.shard.numel() * b.shard.element_size() for b in self.buckets)
        return held

    def grad_bytes(self) -> int:
        """Bytes of gradients held now: whole ones autograd accumulates, reduce-scatter
        buffers in flight, and the shards'."""
        held = 0
        for b in self.buckets:
            if b.grad_full is not None:  # the parameters' and the shard's are views of it
                held += b.grad_full.numel() * b.grad_full.element_size()
            else:
                held += sum(p.grad.numel() * p.grad.element_size() for p in b.params
                            if p.grad is not None)
                held += b.shard.grad.numel() * b.shard.grad.element_size()
            if b.inflight is not None:
                held += b.inflight[1].numel() * b.inflight[1].element_size()
                if b.grad_full is None:
                    held += b.inflight[2].numel() * b.inflight[2].element_size()
        return held

    def _note(self) -> None:
        self.peak["params"] = max(self.peak["params"], self.param_bytes())
        self.peak["grads"] = max(self.peak["grads"], self.grad_bytes())
