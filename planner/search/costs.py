"""A captured model's layer profiles, priced on demand for the search: the bridge between the
cost model (per layer, per strategy) and the ILP's plain numbers."""
from __future__ import annotations

import dataclasses
from functools import cached_property, lru_cache
from typing import Callable

import torch

from cost_model.hardware.cluster import Cluster
from cost_model.ops import fallback as op_fallback
from cost_model.layers.autocast_saved import AUTOCAST_DTYPES
from cost_model.layers.layer_cost import (LayerCost, LayerProfile, check_tensor_parallel, price,
                                          profile_layer)
from cost_model.layers.memory import TrainingMemory
from cost_model.layers.sharding import Sharding
from cost_model.layers.strategy import Strategy
from passes.capture.block_runs import block_kinds, block_runs, describe
from passes.capture.trace import Captured, tensor_bytes
from passes.rewrite.cp_trial import trial_error
from passes.rewrite.context_parallel import why_not
from passes.rewrite.sharding import get_param
from passes.rewrite.tensor_parallel import ShardingError
from planner.search import ilp


class PlanningError(ValueError):
    """No plan satisfies the request; the message says what would."""


def _captured_runs(captured: Captured, kinds, num_blocks: int) -> tuple[tuple[int, int], ...]:
    if len(kinds) == 1:
        return ((0, num_blocks),)
    if num_blocks != len(captured.blocks):
        raise PlanningError(f"{num_blocks} blocks asked of a model captured with "
                            f"{len(captured.blocks)} blocks of {len(kinds)} kinds "
                            f"({describe(captured.blocks)}); capture every block or pass runs=")
    return tuple((r.kind, r.count) for r in block_runs(captured.blocks))


def _check_runs(runs, kinds, num_blocks: int) -> tuple[tuple[int, int], ...]:
    runs = tuple((int(k), int(n)) for k, n in runs)
    if any(not 0 <= k < len(kinds) or n < 1 for k, n in runs) or \
            sum(n for _, n in runs) != num_blocks:
        raise PlanningError(f"runs={runs} must be (kind, count) pairs with kinds in "
                            f"0..{len(kinds) - 1} (the captured kinds) and counts >= 1 summing "
                            f"to the {num_blocks} blocks")
    return runs


class ModelCosts:
    """Layer profiles of one captured model whose repeated block occurs `num_blocks` times, or,
    when its blocks are not all alike, of each kind of block (passes.capture.block_runs): `runs` lists
    (kind, count) in model order, and every per-block method takes the kind (default 0). A
    model captured with fewer blocks than it has (a preset: one block per kind keeps planning
    fast) states its runs: `runs=((0, 3), (1, 58))` is 3 blocks of the first captured kind then
    58 of the second (kinds numbered in order of first appearance among the captured blocks).

    Memory of parameters follows `training` (cost_model.layers.memory); by default the training precision
    decides: a 16-bit model is trained with mixed-precision Adam (16-bit weights and gradients,
    fp32 master weights and two fp32 moments: 2 + 2 + 12 bytes per parameter); an fp32 model with
    plain Adam (4 + 4 + 8). With ZeRO-1 the optimizer part shrinks with the data-parallel size, so
    the memory methods take `dp`.
    """

    def __init__(self, captured: Captured, num_blocks: int, dtype_bytes: int,
                 training: TrainingMemory | None = None,
                 runs: tuple[tuple[int, int], ...] | None = None, autocast: str = ""):
        if not captured.blocks:
            raise PlanningError("found no repeated blocks (an nn.ModuleList or nn.Sequential "
                                "of blocks) to distribute; hold the model's layers in one")
        self.kinds = block_kinds(captured.blocks)
        self.runs = _check_runs(runs, self.kinds, num_blocks) if runs is not None else \
            _captured_runs(captured, self.kinds, num_blocks)
        self.captured = captured
        # the runtime's autocast ("bf16", "fp16"; "": none): what the activations save
        # (cost_model.layers.autocast_saved)
        self.autocast = autocast
        self.num_blocks = num_blocks
        self.dtype_bytes = dtype_bytes
        self.training = training or TrainingMemory.for_dtype(dtype_bytes)
        self.block = captured.blocks[0]
        self.block_prefix = self.block.name.rsplit(".", 1)[0]
        with op_fallback.recording() as unpriced:
            self.ends = {l.kind: self._profile_layer(l) for l in captured.layers
                         if l.kind != "block"}
            # (kind, tp) -> the block of that kind rewritten for tp; kind 0 also under key tp
            self._kind_profiles: dict[tuple[int, int], LayerProfile] = {
                (k, 1): self._profile_layer(layer) for k, layer in enumerate(self.kinds)}
        self.unpriced = tuple(sorted(unpriced))  # ops priced without a rule (the plan says so)
        self.structure_notes: tuple[str, ...] = ()  # what the capture could not follow
        self._profiles: dict[int, LayerProfile] = {1: self._kind_profiles[0, 1]}
        self.tp_errors: dict[int, str] = {}
        self.kind_tp_errors: dict[tuple[int, int], str] = {}  # (kind, tp) -> why it runs whole
        self.vocab_errors: dict[int, str] = {}  # tp -> why the ends are not vocabulary-parallel
        # The search asks for the same prices once per mesh and schedule. Per-instance caches:
        # they go with the ModelCosts instead of keeping every instance alive.
        self._price = lru_cache(maxsize=None)(self._price_uncached)
        self._ep_price = lru_cache(maxsize=None)(self._ep_price_uncached)
        self._per_param = lru_cache(maxsize=None)(self._per_param_uncached)
        self._kind_of = {}  # a block's layer name -> its kind (the first kind of that name)
        for k, layer in reversed(list(enumerate(self.kinds))):
            self._kind_of[layer.name] = k
        # Expert parallelism (planner.search.experts): the EP size the search is at and the hook
        # that prices a MoE block for it (None: as captured, ep = 1).
        self.ep, self.ep_pricing = 1, None
        self.shards_experts = False  # Cluster.shards_experts of the search under way
        # The model captured at two samples, made on first use (planner.api gives the maker):
        # the tensor-parallel rewrite is checked on it too, since a capture of one sample cannot
        # show a view that merges the batch with the heads (size 1 there), which the run's
        # micro-batches then break.
        self.capture_wide: Callable[[], Captured] | None = None
        self._wide: Captured | None = None
        self._ends_priced = lru_cache(maxsize=None)(self._end_costs_uncached)
        self._end_profile = lru_cache(maxsize=None)(self._end_profile_uncached)
        self._vocab_ends = lru_cache(maxsize=None)(self._vocab_ends_uncached)

    def _profile_layer(self, layer, tp: int = 1) -> LayerProfile:
        profile = profile_layer(self.captured, layer, tp, AUTOCAST_DTYPES.get(self.autocast))
        wide = self._wide_capture() if tp > 1 else None
        wide_layer = next((w for w in wide.layers if w.name == layer.name), None) if wide else None
        if wide_layer is not None:  # raises ShardingError as the run's rewrite would
            check_tensor_parallel(wide, wide_layer, tp)
        return profile

    def _wide_capture(self) -> Captured | None:
        """`capture_wide`'s capture, made once; None where there is none (a preset, one sample)
        or it fails, as it may for a model whose inputs are not all batched."""
        if self.capture_wide is not None:
            maker, self.capture_wide = self.capture_wide, None
            try:
                self._wide = maker()
            except Exception as err:  # noqa: BLE001 - the check is extra: the plan says so
                self._wide = None
                self.structure_notes += (
                    f"the model did not capture at two samples ({type(err).__name__}): its "
                    f"tensor-parallel rewrite was checked at one, where a view merging the "
                    f"batch with the heads cannot show",)
        return self._wide

    def block_name(self, i: int) -> str:
        """Block i's layer name: the captured one (a model of several parts names each part's
        blocks by its own list), or, for a preset captured with fewer blocks than it has, its
        list's name and i."""
        blocks = self.captured.blocks
        return blocks[i].name if len(blocks) == self.num_blocks else f"{self.block_prefix}.{i}"

    @property
    def block_sequence(self) -> tuple[int, ...]:
        """The kind of every block, in model order."""
        return tuple(kind for kind, n in self.runs for _ in range(n))

    def kind_of(self, layer: str, default=None):
        """The kind of the block named `layer` (`default` for a layer that is no block)."""
        return self._kind_of.get(layer, default)

    def has(self, kind: str) -> bool:
        return kind in self.ends

    def block_profile(self, tp: int, kind: int | None = None) -> LayerProfile | None:
        """The block of `kind` rewritten for tensor-parallel size tp, or None when it does not
        divide. Without a kind: the first kind's that divides, None when none does (tp is then
        left out: `tp_errors`). A kind that does not divide where others do runs whole on every
        rank of the tp group (strategies without tp: `kind_tp_errors` says why, and the plan)."""
        if tp not in self._profiles and tp not in self.tp_errors:
            errors = {}
            for k, layer in enumerate(self.kinds):
                try:
                    self._kind_profiles[k, tp] = self._profile_layer(layer, tp)
                except ShardingError as err:
                    errors[k] = str(err)
            if len(errors) == len(self.kinds) or (errors and not self._parts_may_differ()):
                k = min(errors)
                named = errors[k].startswith(f"layer {self.kinds[k].name}:")
                where = f"{self.kinds[k].name}: " if len(self.kinds) > 1 and not named else ""
                self.tp_errors[tp] = (f"{where}{errors[k]}; fxpar leaves tp={tp} out for this "
                                      f"model: plan with another tp, or change that op")
            else:
                self.kind_tp_errors.update({(k, tp): why for k, why in errors.items()})
                self._profiles[tp] = next(self._kind_profiles[k, tp]
                                          for k in range(len(self.kinds)) if k not in errors)
        if kind is None or tp not in self._profiles:
            return self._profiles.get(tp)
        return self._kind_profiles.get((kind, tp))

    def _parts_may_differ(self) -> bool:
        """Whether blocks may differ in tensor parallelism: across a model's parts (a vision
        tower whole on each rank beside a tensor-parallel decoder). Within one list of blocks a
        kind that does not divide leaves tp out, as it always has."""
        return len(self.captured.parts) > 1

    def shards(self, tp: int, kind: int) -> bool:
        """Whether blocks of `kind` can be tensor-parallel at tp."""
        return tp > 1 and self.block_profile(tp) is not None and \
            self.block_profile(tp, kind) is not None

    def price_block(self, strategy: Strategy, micro_batch: int, cluster: Cluster,
                    tp: int, cp: int = 1, kind: int = 0) -> LayerCost:
        if self.ep_pricing is None:
            return self._price(strategy, micro_batch, cluster, tp, cp, kind)
        return self._ep_price(self.ep_pricing, strategy, micro_batch, cluster, tp, cp, kind)

    def _ep_price_uncached(self, pricing, strategy, micro_batch, cluster, tp, cp,
                           kind) -> LayerCost:
        """The block priced at the EP size of `pricing` (planner.search.experts.EPPricing)."""
        cost = self._price(strategy, micro_batch, cluster, tp, cp, kind)
        return pricing(cost, micro_batch, cluster, tp if strategy.tp else 1, kind, cp)

    def _price_uncached(self, strategy, micro_batch, cluster, tp, cp, kind=0) -> LayerCost:
        return price(self.block_profile(tp if strategy.tp else 1, kind), strategy, micro_batch,
                     cluster, tp, cp)

    def supports_cp(self, cp: int, seq: int) -> bool:
        """Context parallel needs attention the rewrite turns into a ring (`cp_error` says why
        not) and a sequence that splits into 2·cp zig-zag chunks."""
        return cp == 1 or (self.cp_error is None and seq % (2 * cp) == 0)

    def supports_sp(self, tp: int, cp: int, seq: int) -> bool:
        """Sequence parallel needs the block's sequence-parallel rewrite to apply at tp (its
        profile then holds the collectives) and each rank's seq/cp positions to split over the
        tp ranks (passes.rewrite.sequence_parallel refuses the rest)."""
        if tp == 1 or self.block_profile(tp) is None:
            return False
        applies = [self.kind_sp(tp, k) for k in range(len(self.kinds)) if self.shards(tp, k)]
        # a model of parts: kinds that cannot take it run tp alone beside those that do
        taken = any(applies) if self._parts_may_differ() else all(applies)
        return taken and seq % cp == 0 and (seq // cp) % tp == 0

    def _sp_notes(self, tp: int | None = None) -> list[str]:
        """In a model of parts where some blocks take sequence parallelism: those that do not,
        and why (they run tp alone, planner.search.problem.strategies), at the plan's `tp` (or
        the first tp profiled)."""
        notes = []
        for tp in [tp] if tp else sorted(self._profiles):
            if tp <= 1 or tp not in self._profiles:
                continue
            kinds = [k for k in range(len(self.kinds)) if self.shards(tp, k)]
            if not self._parts_may_differ() or not any(self.kind_sp(tp, k) for k in kinds):
                continue
            for k in (k for k in kinds if not self.kind_sp(tp, k)):
                notes.append(f"blocks of kind {k} ({self.kinds[k].name}) take no sequence "
                             f"parallelism at tp={tp}: {self.block_profile(tp, k).sp_error}")
            break  # the first tp says it; the reasons are the same sizes' at the others
        return notes

    def kind_sp(self, tp: int, kind: int) -> bool:
        """Whether blocks of `kind` take sequence parallelism at tp (their rewrite applies)."""
        return self.shards(tp, kind) and self.block_profile(tp, kind).sp_collectives is not None

    def sp_error(self, tp: int) -> str | None:
        """Why the blocks' sequence-parallel rewrite does not apply at tp (None where it does or
        where tp itself does not)."""
        if tp == 1 or self.block_profile(tp) is None:
            return None
        return next((self.block_profile(tp, k).sp_error for k in range(len(self.kinds))
                     if self.shards(tp, k) and self.block_profile(tp, k).sp_error), None)

    @cached_property
    def cp_error(self) -> str | None:
        """Why passes.rewrite.context_parallel cannot rewrite this model, or None when it can."""
        why = why_not(self.captured.gm, {l.name: l.nodes for l in self.captured.layers})
        if why:  # the rewrite's own reason first: it names the node and the construct
            return why
        # blocks without attention (a hybrid's MLP-only or convolution blocks) run on each
        # rank's tokens: cp_tokens refuses, naming it, any op of theirs that reads across the
        # sequence
        return trial_error(self.captured.gm, {l.name: l.nodes for l in self.captured.layers})

    def end_costs(self, micro_batch: int, cluster: Cluster, padded: bool = False, cp: int = 1,
                  tp: int = 1):
        """LayerCosts of embed and head (None for a missing one when padded): vocabulary-parallel
        over tp ranks when `vocab_parallel` chooses it, else replicated."""
        costs = (self._vocab_ends(micro_batch, cluster, cp, tp)
                 if self.vocab_parallel(tp, micro_batch, cluster, cp)
                 else self._ends_priced(micro_batch, cluster, cp))
        return list(costs) if padded else [c for c in costs if c is not None]

    def _end_costs_uncached(self, micro_batch, cluster, cp) -> tuple:
        return tuple(price(self.ends[k], Strategy(), micro_batch, cluster, 1, cp)
                     if k in self.ends else None for k in ("embed", "head"))

    def vocab_parallel(self, tp: int, micro_batch: int | None = None,
                       cluster: Cluster | None = None, cp: int = 1) -> bool:
        """Whether embed and head run vocabulary-parallel at tp: when the rewrite applies and,
        priced for the micro-batch on the cluster, the two together are no slower. They never
        need more memory (weights, gradients, optimizer states and logits shrink by tp; the
        embedding keeps a one-byte mask per token more), but on tiny layers over slow links the
        added all-reduces cost more than the vocabulary work saved. Without a micro-batch and a
        cluster to price them the ends stay replicated."""
        if tp == 1 or cluster is None or micro_batch is None:
            return False
        if any(self._end_profile(k, tp) is None for k in self.ends):
            return False
        def total(costs):
            return sum(c.fwd_s + c.bwd_s for c in costs if c is not None)
        return total(self._vocab_ends(micro_batch, cluster, cp, tp)) <= total(
            self._ends_priced(micro_batch, cluster, cp))

    def _end_profile_uncached(self, kind: str, tp: int) -> LayerProfile | None:
        """The end layer rewritten vocabulary-parallel (padded) for tp, or None if it cannot be."""
        layer = next(l for l in self.captured.layers if l.kind == kind)
        try:
            return self._profile_layer(layer, tp)
        except ShardingError as err:
            self.vocab_errors[tp] = str(err)
            return None

    def _vocab_ends_uncached(self, micro_batch: int, cluster: Cluster, cp: int, tp: int) -> tuple:
        return tuple(price(self._end_profile(k, tp), Strategy(tp=True), micro_batch, cluster, tp,
                           cp) if k in self.ends else None for k in ("embed", "head"))

    def static_per_param(self, dp=1) -> tuple[float, float]:
        """(weight + gradient bytes, optimizer bytes) per parameter on one rank of a dp group;
        `dp` may be a cost_model.layers.sharding.Sharding (the ZeRO level's shares)."""
        t = self.training
        if isinstance(dp, Sharding):
            fw, fg, fo = dp.fractions()
            if t.zero1 and dp.level == 0:  # the --zero1 pricing of a fixed configuration
                fo = 1 / dp.n
            return t.weight_bytes * fw + t.grad_bytes * fg, t.optimizer_bytes() * fo
        return t.weight_bytes + t.grad_bytes, t.optimizer_bytes(dp)

    def step_share(self, dp=1) -> float:
        """The optimizer step's transient per byte of a rank's static bytes (TrainingMemory.
        step_share of its optimizer part)."""
        weights, opt = self.static_per_param(dp)
        return opt * self.training.step_share() / (weights + opt) if weights + opt else 0.0

    def split_static(self, static_bytes: float, dp: int = 1) -> tuple[float, float]:
        weights, opt = self.static_per_param(dp)
        return static_bytes * weights / (weights + opt), static_bytes * opt / (weights + opt)

    def whole_rate(self, dp) -> float:
        """Static bytes per parameter held whole under ZeRO (`end_layer`): the weight and its
        optimizer states whole; its gradient, made in the backward and dropped after the step,
        is absent at the activation peak, so it counts at the level's rate like the others'."""
        t = self.training
        grads = dp.fractions()[1] if isinstance(dp, Sharding) else 1.0
        return t.weight_bytes + t.grad_bytes * grads + t.optimizer_bytes()

    def _per_param_uncached(self, dp) -> float:
        """Static bytes per parameter on one rank (`static_per_param`, summed)."""
        return sum(self.static_per_param(dp))

    def block_static(self, cost: LayerCost, dp=1) -> float:
        """Static bytes (weights, gradients, optimizer states) one rank holds of a block."""
        static = cost.params * self._per_param(dp)
        if self.ep_pricing is not None:  # expert weights as the runtime shards them
            whole = self.ep_pricing.expert_params(self._kind_of[cost.layer])
            static += whole * (self._per_param(self._expert_sharding(dp)) - self._per_param(dp))
        return static

    def _expert_sharding(self, dp):
        """How a rank holds its experts' states: whole (fxpar's runtime, runtime.training.
        trainer), or at the level of the rest over the ranks that hold the same experts, the
        shard group's n over ep (Cluster.shards_experts: Megatron's expert-data-parallel
        group, FSDP2's experts' mesh)."""
        if not self.shards_experts or not isinstance(dp, Sharding):
            return 1
        return dataclasses.replace(dp, n=max(1, dp.n // self.ep))

    def block_option(self, cost: LayerCost, dp: int = 1) -> ilp.BlockOption:
        return ilp.BlockOption(str(cost.strategy), cost.fwd_s + cost.bwd_s,
                               self.block_static(cost, dp), cost.act_bytes,
                               cost.params * self.training.grad_bytes)

    def end_layer(self, cost: LayerCost | None, dp: int = 1, whole: float = 0.0
                  ) -> ilp.EndLayer:
        """The end layer's terms; `whole` of its parameters held whole whatever the ZeRO level
        (a tied embedding and head: sharded data parallel keeps a weight several layers read
        whole, runtime.data_parallel.sharded_dp)."""
        if cost is None:
            return ilp.EndLayer(0.0, 0.0, 0.0, 0.0)
        whole = min(whole, cost.params)
        static = (cost.params - whole) * self._per_param(dp) + whole * self.whole_rate(dp)
        return ilp.EndLayer(cost.fwd_s + cost.bwd_s, static, cost.act_bytes,
                            cost.params * self.training.grad_bytes)

    @cached_property
    def tied_end_params(self) -> int:
        """Parameters the embedding and the head share (a tied head): on different stages both
        hold them, and their gradients are summed across the two (runtime.training.tied)."""
        def params(kind: str) -> dict[int, int]:
            """The parameters a layer of `kind` reads: its own get_attr and module nodes, and
            those of other layers its nodes use (a head that reads the embedding's weight)."""
            layer = next((l for l in self.captured.layers if l.kind == kind), None)
            found, gm = {}, self.captured.gm
            nodes = {n.name: n for n in gm.graph.nodes}
            for name in (layer.nodes if layer else ()):
                node = nodes[name]
                for read in (node, *node.all_input_nodes):
                    if read.op == "get_attr":
                        value = get_param(gm, str(read.target))
                        if isinstance(value, torch.nn.Parameter):
                            found[id(value)] = value.numel()
                if node.op == "call_module":
                    found.update({id(p): p.numel() for p in
                                  gm.get_submodule(node.target).parameters()})
            return found
        embed, head = params("embed"), params("head")
        return sum(n for key, n in embed.items() if key in head)

    def boundary_bytes(self, micro_batch: int) -> float:
        """Bytes a stage boundary carries: the largest block output of any kind, and what
        earlier layers hand past the cut to later ones (`_carried`), per sample times the
        micro-batch, once for a value the same for every sample."""
        per = micro_batch / self.captured.batch
        return max(p.output_bytes * micro_batch / p.batch
                   for (_, tp), p in self._kind_profiles.items() if tp == 1) + \
            max((sample * per + fixed for sample, fixed in self._carried), default=0.0)

    @property
    def carried_bytes(self) -> float:
        """The most bytes, at the captured batch, that any cut carries (`_carried`)."""
        return max((sample + fixed for sample, fixed in self._carried), default=0.0)

    @cached_property
    def _carried(self) -> list[tuple[float, float]]:
        """Per cut between two layers, the bytes it carries from a layer before the one ending
        at the cut to one after it (passes.stages.pipeline_split passes them through every stage
        in between), at the captured batch: (computed from the inputs, so per sample; computed
        from weights and constants alone, the same for every sample: T5's position bias,
        [1, heads, q, k] from its trained embedding). In a model of several parts: an encoder's
        output read by every decoder block, a decoder's token embeddings made before the encoder
        blocks. A model of one part carries only position tables of a few KiB, left unpriced
        (none) as they always were."""
        captured = self.captured
        if len(captured.parts) < 2:
            return []
        index = {layer.name: layer.index for layer in captured.layers}
        at = {name: index[layer] for name, layer in captured.layer_of().items()}
        last_layer = len(captured.layers) - 1
        inputs = set(captured.input_names)
        sampled: set[str] = set()  # values computed from an input: one per sample
        carried = [[0.0, 0.0] for _ in captured.layers]  # past layer k, from before it
        for node in captured.gm.graph.nodes:
            if node.name in inputs or any(a.name in sampled for a in node.all_input_nodes):
                sampled.add(node.name)
            if node.op in ("placeholder", "output", "get_attr") or node.name not in at:
                continue
            last = max((at.get(u.name, last_layer) for u in node.users), default=0)
            for k in range(at[node.name] + 1, last):
                carried[k][node.name not in sampled] += tensor_bytes(node.meta.get("val"))
        return [(sample, fixed) for sample, fixed in carried]

    def param_count(self) -> int:
        """Every parameter of the model, unsharded (each block kind times its count), a weight
        the embedding and the head share counted once (as model.parameters() does)."""
        blocks = sum(self._kind_profiles[k, 1].params * n for k, n in self.runs)
        return int(blocks + sum(p.params for p in self.ends.values()) - self.tied_end_params)

    def flops_per_sample(self) -> float:
        """Model FLOPs (forward + backward, no recompute) of one sample."""
        profiles = [self._kind_profiles[k, 1] for k, n in self.runs for _ in range(n)]
        profiles += list(self.ends.values())
        return sum(sum(op.fwd_flops + op.bwd_flops for op in p.ops) / p.batch for p in profiles)

    def _describe_blocks(self) -> str:
        """The kinds and runs of blocks: the captured blocks', or the model's runs where one
        block per kind was captured."""
        nodes = {node.name: node for node in self.captured.gm.graph.nodes}
        blocks = self.captured.blocks
        whole = sum(n for _, n in self.runs) == len(blocks)
        return describe(blocks, nodes, None if whole else self.runs)

    def notes(self, tp: int | None = None) -> tuple[str, ...]:
        """What a plan says of the model (tensor and sequence parallelism at the plan's `tp`,
        kinds of blocks, unpriced ops)."""
        notes = []
        if self.tp_errors and not any(t > 1 for t in self._profiles):
            first = min(self.tp_errors)
            notes.append(f"planned without tensor parallelism: no tp size above 1 can shard "
                         f"the model ({self.tp_errors[first]})")
        for k in sorted({k for k, _ in self.kind_tp_errors}):
            sizes = sorted(tp for kind, tp in self.kind_tp_errors if kind == k)
            notes.append(f"blocks of kind {k} ({self.kinds[k].name}) run whole on every rank "
                         f"of the tp group at tp={'/'.join(map(str, sizes))}: "
                         f"{self.kind_tp_errors[k, sizes[0]]}")
        notes += self._sp_notes(tp)
        if len(self.kinds) > 1:
            notes.append(f"blocks of {len(self.kinds)} kinds, priced per kind and split into "
                         f"contiguous stages: "
                         f"{self._describe_blocks()}")
        if self.unpriced:
            notes.append(f"priced as memory-bound, without a cost rule (their time may be "
                         f"underestimated): {'; '.join(self.unpriced[:4])}"
                         + (f" and {len(self.unpriced) - 4} more" if len(self.unpriced) > 4
                            else ""))
        return tuple(notes) + self.structure_notes

    def selective_notes(self, tp: int, strategies) -> tuple[str, ...]:
        """Where a plan's selective recomputation drops nothing: a kind whose attention is one
        fused kernel (scaled_dot_product_attention) keeps no [s, s] scores to drop, so "sel"
        prices as no recomputation - true of that kernel, and said so that the tie is not taken
        for a fault of the cost model."""
        if not any("sel" in s.split("+") for s in strategies):  # the ends' are no Strategy
            return ()
        fused = [k for k in range(len(self.kinds)) if (p := self.block_profile(tp, k)) and
                 not any(op.core for op in p.ops)]
        if not fused:
            return ()
        which = ("the blocks" if len(self.kinds) == 1 else
                 "blocks of kind " + "/".join(map(str, fused)))
        return (f"selective recomputation drops nothing in {which}: their attention is one "
                f"fused kernel (scaled_dot_product_attention), which keeps no scores to drop, "
                f"so sel is priced as none",)
