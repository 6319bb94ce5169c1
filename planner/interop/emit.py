"""`fxpar plan --emit torchtitan|megatron`: a plan as the other framework's configuration.

Names checked against (see tests/unit/test_emit.py for the versions):

* torchtitan: the TOML fields of torchtitan/config/job_config.py (`[parallelism]`,
  `[activation_checkpoint]`, `[training]`), whose pipeline stages are named by
  `pipeline_parallel_split_points`; schedule class names as
  torch.distributed.pipelining.schedules.get_schedule_class knows them; a schedule with no class
  (fxpar's zb-h1) goes as a per-rank CSV of compute actions (`<stage><F|I|W|B><micro-batch>`, one
  row per pipeline rank, the format `_PipelineScheduleRuntime._load_csv` reads), which torchtitan
  loads from `pipeline_parallel_schedule_csv`.
* Megatron-LM: the flags of megatron/training/arguments.py; uneven stages as
  `--pipeline-model-parallel-layout` ("Et*5|t*6|...|t*5L": E the embedding, t a transformer layer,
  L the loss with the output layer, stages split by "|").

What the target cannot express (a schedule, a per-layer mix of strategies, replicated ends at
tp > 1, ...) is said in a comment line, and the nearest configuration it can express is emitted
instead, priced by fxpar's cost model beside the plan (planner.interop.configuration: the same mesh and stage
layout, only what the target cannot express changed; among several candidates the fastest that
fits). The model's definition is written as planner.interop.megatron_model states it, with what no
flag states among those lines; planner.interop.expressible plans among the layouts a target
states where fxpar's plan uses what it cannot.
"""
from __future__ import annotations

import csv
import io
import os
import shlex
from dataclasses import dataclass, field, replace

from cost_model.layers.strategy import Strategy
from planner.search.plan import Plan
from planner.interop.configuration import Configuration, Priced, Pricer, compare
from planner.interop.expert_layout import megatron_flags, nearest_ep, torchtitan_shard
from planner.interop.megatron_model import (VOCAB_DIVISOR, emitted_flags, vocab_divisor,
                                             vocab_padding_note)
from planner.interop.model_facts import ModelFacts, facts_of_config, facts_of_hf
from planner.interop.recompute_patterns import pattern_recompute, recompute_of, with_flags

TARGETS = {"torchtitan": "torchtitan", "megatron": "Megatron-LM"}
# fxpar schedule -> torch.distributed.pipelining class name (get_schedule_class's keys)
TORCHTITAN_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B"}
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


def model_of_args(args, seq: int | None = None, global_batch: int | None = None):
    """(model, example inputs or None, ModelFacts) as `fxpar plan` builds them from its flags:
    `args.build_config` and `args.build_hf` are the command line's own builders (planner.cli
    hands them over, so that nothing here imports it)."""
    if seq is not None or global_batch is not None:
        args = _with(args, seq=seq or args.seq, global_batch=global_batch or args.global_batch)
    flag = (f"--emit {args.emit}" if getattr(args, "emit", None) else "--from-megatron"
            if getattr(args, "from_megatron", None) is not None else "--from-torchtitan")
    if args.hf or args.hf_config:
        model, inputs = args.build_hf(args)
        _one_chain(model, flag)
        return model, inputs, facts_of_hf(model, inputs[0].shape[1], inputs[0].shape[0])
    config = args.build_config(args)
    if not getattr(config, "sequences", True):  # a diffusion transformer's latents
        raise ValueError(f"{flag}: {args.model} is a diffusion transformer; Megatron-LM's GPT "
                         f"flags and torchtitan's model code state decoder-only language "
                         f"models, so neither states it: plan and train it with fxpar's own "
                         f"runtime (`fxpar plan`, `fxpar train`)")
    return config, None, facts_of_config(config)


def _one_chain(model, flag: str) -> None:
    """Megatron-LM's GPT flags and torchtitan's model code state a decoder-only model, one chain
    of blocks: a model of several lists of blocks (an encoder and a decoder, a vision tower and
    a decoder) is refused, its parts named, rather than written or priced as another model."""
    from passes.capture.trace import block_lists
    lists = block_lists(model)
    if len(lists) < 2:
        return
    parts = ", ".join(f"{name} x{len(model.get_submodule(name))}" for name in lists)
    name = type(getattr(model, "model", model)).__name__
    raise ValueError(f"{flag}: {name} has {len(lists)} lists of blocks ({parts}); Megatron-LM's "
                     f"GPT flags and torchtitan's model code state a decoder-only chain of "
                     f"blocks, so neither states this model: plan and train it with fxpar's own "
                     f"runtime (`fxpar plan`, `fxpar train`)")


def _with(args, **changes):
    import argparse
    return argparse.Namespace(**{**vars(args), **changes})


def pricer_of_args(args, seq: int | None = None, global_batch: int | None = None,
                   zero1: bool | None = None, runtime: str | None = None
                   ) -> tuple[Pricer, ModelFacts]:
    model, inputs, facts = model_of_args(args, seq, global_batch)
    pricer = Pricer(model, args.gpus, inputs, cluster=args.cluster,
                    global_batch=global_batch or args.global_batch, memory_limit=args.memory_limit,
                    zero1=args.zero1 if zero1 is None else zero1,
                    runtime=runtime_of_args(args, runtime),
                    moe_imbalance=getattr(args, "moe_imbalance", None))
    return pricer, facts


def runtime_of_args(args, wanted: str | None = None) -> str:
    """--runtime, else the framework the configuration is written for or read from: a plan
    emitted for Megatron is the one fastest under Megatron-Core's runtime profile; `wanted`, the
    profile an imported configuration asks for (torchtitan's compile). CPU ranks run fxpar's own
    runtime only (runtimes.apply), and their profile measured it."""
    from cost_model.hardware.cluster import get_cluster
    from planner.api import default_cluster
    if getattr(args, "runtime", None):
        return args.runtime
    if get_cluster(args.cluster or default_cluster()).device == "cpu":
        return "fxpar"
    if wanted:
        return wanted
    if getattr(args, "emit", None):
        return args.emit
    return "megatron" if getattr(args, "from_megatron", None) is not None else "torchtitan"


def _mix(stages) -> str:
    """'tp x 70, tp+full x 10' over all blocks."""
    counts: dict[str, int] = {}
    for stage in stages:
        for s in stage:
            counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{s} x{n}" for s, n in counts.items())


# --------------------------------------------------------------------------------------------
# The nearest configuration a target expresses
# --------------------------------------------------------------------------------------------
@dataclass
class Expressed:
    config: Configuration
    notes: list[str] = field(default_factory=list)     # what the target cannot express
    pattern: tuple = ("uniform", "none")               # the recomputation as the target states it
    priced: Priced | None = None                       # None: the plan itself (exact)
    # read back (--from-*): "" the same plan, None not read back, else what differs
    round_trip: str | None = None
    definition: list[str] = field(default_factory=list)  # what of the model it cannot state
    model_differs: bool = False   # the stated model is not the model (Megatron-LM's nearest)
    # the plan the configuration states, where it is not fxpar's own: planned among the
    # layouts the target can state (planner.interop.expressible)
    planned: Plan | None = None

    @property
    def exact(self) -> bool:
        return self.priced is None


def nearest(target: str, plan: Plan, pricer_factory) -> Expressed:
    """The configuration of `plan` that `target` can express; `pricer_factory()` gives the
    Pricer when something has to be priced. Expert parallelism the target cannot state at all
    is refused (planner.interop.expert_layout.Unstated): a nearest priced without it would
    mislead."""
    label = TARGETS[target]
    own = Configuration.of(plan)
    config, notes = own, []
    if plan.pp > 1 or plan.virtual_stages > 1:
        schedules = MEGATRON_SCHEDULES if target == "megatron" else (
            *TORCHTITAN_SCHEDULES, "zb-h1")
        if plan.schedule not in schedules:
            config = replace(config, schedule="1f1b", v=1, split_backward="")
            notes.append(f"{label} has no {plan.schedule} schedule; nearest: 1f1b")
    elif plan.schedule != "1f1b":
        config = replace(config, schedule="1f1b", split_backward="")
        notes.append(f"without a pipeline {label} runs a plain step; fxpar priced its "
                     f"{plan.schedule} there (its own runtime's form of the backward); "
                     f"nearest: 1f1b")
    if plan.tp > 1 and config.ends != "vocab-tp":
        config = replace(config, ends="vocab-tp")
        notes.append(f"fxpar keeps the embedding and head replicated at tp={plan.tp}; {label} "
                     f"always splits them over the vocabulary")
    config, zero_notes = _sharding(target, config)
    notes += zero_notes
    config, ep_notes = nearest_ep(target, config)
    notes += ep_notes
    unpriced = []  # what the target runs that fxpar prices otherwise: never "exact"
    if target == "torchtitan":
        config, split_notes = _torchtitan_split(config)
        notes += split_notes
        config, unpriced = _torchtitan_split_backward(config)
        notes += unpriced
    stages, tp = config.stages, plan.tp > 1
    lengths = [len(st) for st in stages]
    strategies = [Strategy.parse(s) for st in stages for s in st]
    sps = {s.sp for s in strategies}
    if target == "torchtitan":
        sp_options = [tp]
        if tp and sps != {True}:
            notes.append("torchtitan's tensor parallelism is always sequence-parallel (norms "
                         "and dropout split over the sequence); nearest: tp+sp")
    else:
        sp_options = [sps.pop()] if len(sps) == 1 else [True, False]
        if len(sp_options) > 1:
            notes.append(f"Megatron-LM's --sequence-parallel is for every layer; fxpar mixes "
                         f"{_mix(stages)}")
    if tp and not all(s.tp for s in strategies):
        notes.append(f"{label} splits every layer over tp={plan.tp}; fxpar mixes {_mix(stages)}")
    own_pattern = _pattern(target, recompute_of(stages), lengths, plan.pp)
    patterns = [own_pattern] if own_pattern else _patterns(target, lengths, plan.pp)
    if own_pattern is None:
        notes.append(f"{label} cannot state fxpar's per-layer recomputation ({_mix(stages)})")
    candidates = [(with_flags(stages, tp, sp, pattern_recompute(lengths, p, plan.pp)), p)
                  for sp in sp_options for p in patterns]
    first, pattern = candidates[0]
    config = replace(config, stages=first)
    if config == own and not unpriced:
        return Expressed(own, notes, pattern)
    pricer = pricer_factory()
    best = None
    for stages_, p in candidates:
        priced = pricer.price(replace(config, stages=stages_))
        key = (not priced.fits, priced.iteration_s if priced.fits
               else priced.plan.predicted.peak_memory_bytes)
        if best is None or key < best[0]:
            best = (key, priced, stages_, p)
    _, priced, stages_, pattern = best
    if len(candidates) > 1:
        notes.append(f"nearest: {_mix(stages_)}, the fastest of the {len(candidates)} that "
                     f"{label} can state" + ("" if priced.fits else " (none fits: the smallest)"))
    return Expressed(replace(config, stages=stages_), notes, pattern, priced)


# what torch.distributed.pipelining's I and W run (its _backward.stage_backward_input and
# stage_backward_weight), said by --emit torchtitan and read by --from-torchtitan alike
TORCHTITAN_SPLIT = ("torchtitan's pipelining splits the backward by recording: I keeps the "
                    "gradients where the weights' paths join, W reads them")


def _torchtitan_split_backward(config: Configuration) -> tuple[Configuration, list[str]]:
    """ZB-H1 in torchtitan is fxpar's split_backward=record, which fxpar prices only without
    recomputation (planner.search.meshes); with it, the nearest it prices is W walking again."""
    if config.schedule != "zb-h1" or config.split_backward == "record":
        return config, []
    if torchtitan_records(config):
        return replace(config, split_backward="record"), [
            f"{TORCHTITAN_SPLIT}; nearest: split_backward=record"]
    return config, [recorded_with_recompute()]


def torchtitan_records(config: Configuration) -> bool:
    """Whether torchtitan's run of `config` is one fxpar prices as split_backward=record: ZB-H1
    with no block recomputed."""
    return config.schedule == "zb-h1" and \
        {r for stage in recompute_of(config.stages) for r in stage} == {"none"}


def recorded_with_recompute() -> str:
    return (f"{TORCHTITAN_SPLIT}, through its recomputed layers too; fxpar prices recording "
            f"only without recomputation: priced as W walking the graph again, which keeps less")


def _sharding(target: str, config: Configuration) -> tuple[Configuration, list[str]]:
    """The data-parallel sharding the target states: Megatron-LM every ZeRO level (its
    distributed optimizer for 1, Megatron-FSDP for 2 and 3) but not hybrid sharding;
    torchtitan replicas (DDP) or FSDP (ZeRO-3, hybrid with a replicate degree), not 1 or 2;
    with context parallelism always FSDP, its mesh taking the cp ranks in (dp_shard x cp)."""
    if target == "torchtitan" and config.cp > 1 and config.zero == 0:
        return replace(config, zero=3, dp_shard=1 if config.dp > 1 else None), [
            f"torchtitan shards the weights (FSDP) over the {config.cp} context-parallel ranks "
            f"whatever the data-parallel degrees; nearest: FSDP over them (zero=3, "
            f"data_parallel_shard_degree 1)"]
    if config.dp * config.cp == 1 or (config.zero == 0 and not config.dp_shard):
        return config, []
    if target == "megatron" and config.dp_shard and config.dp_shard != config.dp:
        return replace(config, dp_shard=None), [
            f"Megatron-LM has no hybrid sharding flag (zero={config.zero} over groups of "
            f"{config.dp_shard} of the {config.dp} data-parallel ranks); nearest: sharded over "
            f"all {config.dp}"]
    if target == "torchtitan" and config.zero in (1, 2):
        return replace(config, zero=3), [
            f"torchtitan shards data parallel with FSDP (weights, gradients and optimizer "
            f"states), not ZeRO-{config.zero}; nearest: FSDP (zero=3)"]
    return config, []


def _pattern(target: str, recompute: list[list[str]], lengths: list[int], ranks: int):
    """The target's statement of this recomputation, or None."""
    kinds = {r for row in recompute for r in row}
    if len(kinds) <= 1:
        return ("uniform", kinds.pop() if kinds else "none")
    for p in _patterns(target, lengths, ranks):
        if p[0] != "uniform" and pattern_recompute(lengths, p, ranks) == recompute:
            return p
    return None


def _patterns(target: str, lengths: list[int], ranks: int) -> list[tuple]:
    uniform = [("uniform", r) for r in ("none", "selective", "full")]
    if target == "megatron":
        return uniform + [("block", k) for k in range(1, max(lengths, default=1))]
    per_rank = max(sum(lengths[s] for s in range(r, len(lengths), ranks)) for r in range(ranks))
    return uniform + [("every", n) for n in range(2, max(per_rank, 2) + 1)]


def _torchtitan_split(config: Configuration) -> tuple[Configuration, list[str]]:
    """Split points name the first layer of each stage after the first: a stage past the first
    without a transformer layer cannot be named; nearest: the blocks spread evenly."""
    if all(config.stages[1:]) or len(config.stages) == 1:
        return config, []
    n, count = sum(map(len, config.stages)), len(config.stages)
    spread, blocks = [], [s for st in config.stages for s in st]
    for s in range(count):
        take = n // count + (1 if s < n % count else 0)
        spread.append(tuple(blocks[:take]))
        blocks = blocks[take:]
    return replace(config, stages=tuple(spread)), [
        "a torchtitan split point names a stage's first transformer layer; fxpar leaves a stage "
        "without one; nearest: the layers spread evenly"]


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------
def layout_text(plan: Plan) -> str:
    """'dp=8 tp=4 pp=16 cp=2 zero=1, 1f1b, 192 micro-batches of 1'."""
    return (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp}"
            + (f" ep={plan.ep}" if plan.ep > 1 else "")
            + (f" zero={plan.zero}" if plan.zero else "")
            + (f" dp_shard={plan.dp_shard}" if plan.dp_shard and plan.dp_shard != plan.dp
               else "") + f", {plan.schedule}"
            + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
            + f", {plan.num_microbatches} micro-batch"
            f"{'es' if plan.num_microbatches > 1 else ''} of {plan.micro_batch}")


def _head(plan: Plan, label: str, expressed: Expressed) -> list[str]:
    # the runtime priced, as `fxpar plan --runtime R` prints the same plan (runtime_of_args)
    # said before the plan: the target's runtime may plan another layout than fxpar's own
    runtime = (f" under the {plan.runtime} runtime (`fxpar plan --runtime {plan.runtime}`)"
               if plan.runtime and plan.runtime != "fxpar" else "")
    lines = [f"# {label} configuration for fxpar's plan{runtime}: {plan.model} on {plan.gpus} "
             f"GPUs ({plan.cluster}), {layout_text(plan)}"]
    lines += [f"# {n}" if n.startswith("nearest") else f"# not expressible: {n}"
              for n in expressed.notes]
    p = plan.predicted
    if expressed.exact and expressed.round_trip:  # read back, it differs
        lines.append(f"# fxpar plan: {p.iteration_s:.4g} s/iteration; {label} "
                     f"configuration: the same, but read back it prices another plan: "
                     f"{expressed.round_trip}")
    elif expressed.exact and expressed.model_differs:  # never "exact": the model is not
        lines.append(f"# fxpar plan: {p.iteration_s:.4g} s/iteration; {label} configuration: "
                     f"the same parallel plan ({_checked(expressed)}), for the nearest model "
                     f"{label} can state: the differences above")
    elif expressed.exact:
        model = ("; the model's definition as the lines above say" if expressed.definition
                 else "")
        lines.append(f"# fxpar plan: {p.iteration_s:.4g} s/iteration; {label} configuration: "
                     f"the same plan (expressed exactly: {_checked(expressed)}){model}")
    else:
        lines.append("# " + compare(plan, expressed.priced, f"nearest {label} configuration"))
        if expressed.planned is not None and expressed.round_trip:
            lines.append(f"# note: read back, it prices another plan than the one planned: "
                         f"{expressed.round_trip}")
    return lines


def _checked(expressed: Expressed) -> str:
    return ("read back, it prices this very plan" if expressed.round_trip == "" else
            "not read back: the model's facts were not given")


# Megatron-FSDP's --data-parallel-sharding-strategy per ZeRO level (its README: the strategy with
# --use-megatron-fsdp, --use-distributed-optimizer, --no-gradient-accumulation-fusion and
# --ckpt-format fsdp_dtensor)
MEGATRON_FSDP = {2: "optim_grads", 3: "optim_grads_params"}


def megatron(plan: Plan, expressed: Expressed, facts: ModelFacts | None) -> str:
    """Megatron-LM command-line flags, one per line, continued with backslashes."""
    config = expressed.config
    lines = _head(plan, "Megatron-LM", expressed)
    lines.append(f"# data parallel: {config.dp} (Megatron-LM derives it from the world size "
                 f"{plan.gpus} / (tp x pp x cp))"
                 + (f"; expert parallel: {config.ep} of the dp x cp = {config.dp * config.cp} "
                    f"ranks" if config.ep > 1 else ""))
    flags: list[str] = []
    if facts is not None:
        flags += emitted_flags(facts, plan.seq)[0]
        divisor = vocab_divisor(facts.vocab, config.tp)
        if divisor != VOCAB_DIVISOR:  # the model's own vocabulary, not Megatron-LM's padding
            flags.append(f"--make-vocab-size-divisible-by {divisor}")
    flags += [f"--tensor-model-parallel-size {config.tp}",
              f"--pipeline-model-parallel-size {config.pp}",
              f"--context-parallel-size {config.cp}"]
    flags += megatron_flags(config, facts is not None and facts.experts is not None)
    lengths = [len(st) for st in config.stages]
    stages = config.pp * config.v
    even = len(set(lengths)) == 1
    if stages > 1 and not even:
        flags.append(f"--pipeline-model-parallel-layout {shlex.quote(_layout(lengths))}")
    elif config.v > 1:
        flags.append(f"--num-layers-per-virtual-pipeline-stage {lengths[0]}")
    blocks = [Strategy.parse(s) for st in config.stages for s in st]
    if config.tp > 1 and all(s.sp for s in blocks):
        flags.append("--sequence-parallel")
    kind, value = expressed.pattern
    if kind == "uniform" and value == "selective":
        flags.append("--recompute-granularity selective")
    elif kind == "uniform" and value == "full":
        flags += ["--recompute-granularity full", "--recompute-method uniform",
                  "--recompute-num-layers 1"]
    elif kind == "block":
        flags += ["--recompute-granularity full", "--recompute-method block",
                  f"--recompute-num-layers {value}"]
    flags += [f"--micro-batch-size {config.micro_batch}",
              f"--global-batch-size {plan.global_batch}"]
    if config.zero == 1:  # (--zero1 fixed it in the plan; a Configuration at dp=1 has 0)
        flags.append("--use-distributed-optimizer")
    elif config.zero in MEGATRON_FSDP:  # with the flags it requires
        flags += ["--use-megatron-fsdp",
                  f"--data-parallel-sharding-strategy {MEGATRON_FSDP[config.zero]}",
                  "--use-distributed-optimizer", "--no-gradient-accumulation-fusion",
                  "--ckpt-format fsdp_dtensor"]
    if facts is None or facts.dtype_bytes == 2:
        flags.append("--bf16")
    return "\n".join(lines + [f + " \\" for f in flags[:-1]] + flags[-1:])


def definition_notes(target: str, facts: ModelFacts | None, seq: int = 0,
                     tp: int = 1) -> list[str]:
    """What of the model's definition the target's configuration cannot state."""
    if facts is None:
        return []
    if target == "megatron":
        padding = vocab_padding_note(facts.vocab, vocab_divisor(facts.vocab, tp), tp)
        return emitted_flags(facts, seq or facts.seq)[1] + ([padding] if padding else [])
    head = f", head width {facts.head_dim}" if facts.head_dim else ""
    return [f"the model itself: torchtitan builds it from its own model code ([model] name "
            f"and flavor), not from this file; choose one matching {facts.name} ({facts.layers} "
            f"layers, hidden {facts.hidden}, {facts.heads} heads / {facts.kv_heads} kv{head}, FFN "
            f"{facts.ffn}, vocabulary {facts.vocab})"]


def _layout(lengths: list[int]) -> str:
    """Megatron's layout string, runs of equal middle stages folded: 'Et*5|(t*6|)*14t*5L'."""
    def stage(n: int) -> str:
        return "t" if n == 1 else f"t*{n}" if n else ""
    first, last, middle = lengths[0], lengths[-1], lengths[1:-1]
    parts, i = [], 0
    while i < len(middle):
        j = i
        while j < len(middle) and middle[j] == middle[i]:
            j += 1
        run = j - i
        parts.append(f"({stage(middle[i])}|)*{run}" if run > 1 else stage(middle[i]) + "|")
        i = j
    return f"E{stage(first)}|" + "".join(parts) + f"{stage(last)}L"


def torchtitan(plan: Plan, expressed: Expressed,
               csv_path: str | None = None) -> tuple[str, str | None]:
    """The TOML fragment and, for a schedule without a class, the CSV text (written to
    `csv_path` by the caller)."""
    config = expressed.config
    m = (expressed.planned or plan).num_microbatches  # the configuration's own micro-batches
    lines = _head(plan, "torchtitan", expressed)
    shard = torchtitan_shard(config)  # FSDP's shard groups, replicated across them (HSDP)
    replicate = config.dp // shard
    if config.zero != 3:
        if config.cp == 1 and config.dp > 1 and (config.tp > 1 or config.pp > 1):
            lines.append("# note: torchtitan releases whose DDP does not compose with tp/pp "
                         "(\"DDP has not supported > 1D parallelism\") need "
                         "data_parallel_shard_degree (FSDP) instead")
    body = ["[parallelism]",
            f"data_parallel_replicate_degree = {replicate}",
            f"data_parallel_shard_degree = {shard}",
            f"tensor_parallel_degree = {config.tp}",
            f"pipeline_parallel_degree = {config.pp}",
            f"context_parallel_degree = {config.cp}"]
    if config.ep > 1:  # (at tp = 1 only: expert_tensor_parallel_degree's default 1 is tp)
        body.append(f"expert_parallel_degree = {config.ep}  # of data_parallel_shard_degree x "
                    f"context_parallel_degree")
    if config.tp > 1:
        body.append("disable_loss_parallel = false  # the head's logits stay split into the loss")
    table = None
    if config.pp > 1:
        if config.schedule in TORCHTITAN_SCHEDULES:
            body.append(f'pipeline_parallel_schedule = "{TORCHTITAN_SCHEDULES[config.schedule]}"')
        else:
            table = schedule_csv(config.schedule, config.pp, m, config.v)
            single = "PipelineScheduleSingle" if config.v == 1 else "PipelineScheduleMulti"
            lines.append(f"# pipeline_parallel_schedule_csv: fxpar's {config.schedule} as "
                         f"torch.distributed.pipelining compute actions (<stage><F|I|W|B>"
                         f"<micro-batch>, one row per pipeline rank), written to "
                         f"{os.path.abspath(csv_path) if csv_path else '(not written)'}")
            body += [f'pipeline_parallel_schedule = "{single}"',
                     f'pipeline_parallel_schedule_csv = "{csv_path or ""}"']
        body.append(f"pipeline_parallel_microbatch_size = {config.micro_batch}")
        points, first = [], 0
        for stage in config.stages[:-1]:
            first += len(stage)
            points.append(f'"layers.{first}"')
        body.append(f"pipeline_parallel_split_points = [{', '.join(points)}]")
    kind, value = expressed.pattern
    body += ["", "[activation_checkpoint]"]
    if kind == "every":
        body += ['mode = "selective"', f'selective_ac_option = "{value}"  # one layer in '
                 f'{value} of each rank fully recomputed']
    elif value == "selective":
        lines.append("# note: torchtitan's selective (op) recomputes element-wise work and keeps "
                     "matmul and attention outputs; fxpar priced its own selective (the "
                     "attention core recomputed)")
        body += ['mode = "selective"', 'selective_ac_option = "op"']
    else:
        body.append(f'mode = "{value}"')
    # torchtitan's local batch is one forward of each data-parallel rank, and it accumulates
    # gradients over global // (local x dp) of them; a pipeline splits it into micro-batches
    local = config.micro_batch * (m if config.pp > 1 else 1)
    body += ["", "[training]",
             f"local_batch_size = {local}",
             f"global_batch_size = {plan.global_batch}",
             f"seq_len = {plan.seq}"]
    return "\n".join(lines + body), table


def schedule_csv(name: str, pp: int, m: int, v: int = 1) -> str:
    """fxpar's schedule as the compute-only CSV torch.distributed.pipelining reads: one row per
    rank, its F, B, I and W actions in order. fxpar's action text is the same (stage, kind,
    micro-batch: '2F0' is stage 2's forward of micro-batch 0), so only the communication
    actions are dropped: torch inserts its own."""
    from runtime.pipeline.generators import make_schedule
    schedule = make_schedule(name, pp, m, v)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.actions:
        writer.writerow([str(a) for a in actions if a.is_compute])
    return out.getvalue()


def default_csv_path(plan: Plan) -> str:
    return f"fxpar-{plan.schedule}-pp{plan.pp}-m{plan.num_microbatches}.csv"


def emit(target: str, plan: Plan, pricer_factory, facts: ModelFacts | None = None,
         csv_path: str | None = None) -> tuple[str, str | None]:
    """(text, CSV text or None) of `plan` for `target` ("torchtitan" or "megatron"), not read
    back (planner.interop.round_trip.emit_checked reads it back)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    return write(target, plan, nearest(target, plan, pricer_factory), facts, csv_path)


def write(target: str, plan: Plan, expressed: Expressed, facts: ModelFacts | None,
          csv_path: str | None = None) -> tuple[str, str | None]:
    expressed.definition = definition_notes(target, facts, plan.seq, expressed.config.tp)
    expressed.model_differs = target == "megatron" and bool(expressed.definition)
    expressed.notes[:0] = [n for n in expressed.definition if n not in expressed.notes]
    if target == "megatron":
        return megatron(plan, expressed, facts), None
    return torchtitan(plan, expressed, csv_path)
