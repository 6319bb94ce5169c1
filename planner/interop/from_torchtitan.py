"""A torchtitan TOML file as a `planner.interop.configuration.Configuration` (see planner.interop.price_imported): the
parallelism degrees (expert parallelism as planner.interop.expert_layout reads it), the pipeline's
split points or model parts and schedule (a schedule CSV included), and activation checkpointing;
beside them, torch.compile as the runtime profile to price under (torchtitan-compile), and what
fxpar does not price (float8 converters, async tensor parallelism, ...) as notes, the rest listed
as ignored."""
from __future__ import annotations

import json
import os
import re
from dataclasses import replace

from cost_model.layers.strategy import Strategy
from planner.interop.emit import (ModelFacts, recorded_with_recompute, schedule_csv,
                                  torchtitan_records)
from planner.interop.expert_layout import torchtitan_ep
from planner.interop.recompute_patterns import pattern_recompute, with_flags
from planner.interop.readers import Imported, sized
from planner.interop.configuration import Configuration, even_stages


TORCHTITAN_FIELDS = {
    "parallelism": {
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "pipeline_parallel_degree", "context_parallel_degree", "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv", "pipeline_parallel_split_points",
        "pipeline_parallel_layers_per_stage", "pipeline_parallel_microbatch_size",
        "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "disable_loss_parallel",
        "enable_async_tensor_parallel", "enable_compiled_autograd", "fsdp_reshard_after_forward",
        "context_parallel_rotate_method", "expert_parallel_degree",
        "expert_tensor_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option",
                              "per_op_sac_force_recompute_mm_shapes_by_fqns"},
    "training": {"dataset", "dataset_path", "local_batch_size", "batch_size",
                 "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
                 "mixed_precision_param", "mixed_precision_reduce", "compile", "gc_freq",
                 "gc_debug", "seed", "deterministic", "warmup_steps"},
}
# Fields read into the configuration or a note; the others of TORCHTITAN_FIELDS are listed as
# ignored (data, steps, seeds: no effect on the price) unless NOTED says what fxpar does instead
READ = {"data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "pipeline_parallel_degree", "context_parallel_degree", "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv", "pipeline_parallel_split_points",
        "pipeline_parallel_layers_per_stage", "pipeline_parallel_microbatch_size",
        "module_fqns_per_model_part", "disable_loss_parallel", "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "enable_async_tensor_parallel", "fsdp_reshard_after_forward", "mode",
        "selective_ac_option", "local_batch_size", "batch_size", "global_batch_size", "seq_len",
        "compile", "mixed_precision_param", "mixed_precision_reduce", "enable_cpu_offload"}
NOTED = {
    "pipeline_parallel_first_stage_less_layers": "not read: the stages are priced as the split "
                                                 "points, or an even spread, place them",
    "pipeline_parallel_last_stage_less_layers": "not read: the stages are priced as the split "
                                                "points, or an even spread, place them",
    "enable_compiled_autograd": "not priced differently",
    "context_parallel_rotate_method": "priced as fxpar's ring attention, whatever the method",
    "per_op_sac_force_recompute_mm_shapes_by_fqns": "not priced: fxpar's selective "
                                                    "recomputation keeps every matmul's output",
}
TORCHTITAN_IGNORED = {"job", "profiling", "metrics", "model", "optimizer", "lr_scheduler",
                      "checkpoint", "float8", "mx", "comm", "memory_estimation",
                      "fault_tolerance", "experimental", "validation", "compile", "quantize"}
LOW_PRECISION = ("float8", "mx", "quantize")  # sections of low-precision training
TORCHTITAN_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved-1f1b"}
SINGLE_STAGE = {"1f1b", "gpipe", "pipelineschedulesingle"}


def _load_toml(path: str) -> dict:
    import tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not TOML: {err}") from None


def _sections(data: dict, path: str) -> list[str]:
    """The sections listed as ignored; every unknown section and field named in one error."""
    ignored, unknown = [], []
    for section, body in data.items():
        if section in TORCHTITAN_IGNORED:
            if section not in ("model", "compile") + LOW_PRECISION:  # those: _beside_layout
                ignored.append(f"[{section}]")
            continue
        if section not in TORCHTITAN_FIELDS:
            unknown.append(f"section [{section}]")
            continue
        if not isinstance(body, dict):
            raise ValueError(f"[{section}] in {path} must be a table")
        unknown += [f"field [{section}] {name}" for name in body
                    if name not in TORCHTITAN_FIELDS[section]]
    if unknown:
        raise ValueError(f"unknown torchtitan {', '.join(unknown)} in {path}: remove or correct "
                         f"{'them' if len(unknown) > 1 else 'it'}")
    return ignored


def _field(data: dict, section: str, name: str, kind, default=None):
    value = data.get(section, {}).get(name, default)
    where = f"[{section}] {name}"
    if value is default:
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {value!r}")
    if kind is list and not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {value!r}")
    return value


def torchtitan_configuration(path: str, facts: ModelFacts, gpus: int, ours_seq=None,
                             ours_batch=None, ours_zero1=False) -> Imported:
    data = _load_toml(path)
    notes: list[str] = []
    ignored = _sections(data, path)
    get = lambda name, kind, default=None: _field(data, "parallelism", name, kind,  # noqa: E731
                                                  default)
    replicate = get("data_parallel_replicate_degree", int, 1)
    shard = get("data_parallel_shard_degree", int, -1)
    tp = get("tensor_parallel_degree", int, 1)
    pp = get("pipeline_parallel_degree", int, 1)
    cp = get("context_parallel_degree", int, 1)
    for name, value in (("data_parallel_replicate_degree", replicate),
                        ("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp),
                        ("context_parallel_degree", cp)):
        if value < 1:
            raise ValueError(f"[parallelism] {name} must be at least 1, got {value}")
    rest = replicate * tp * pp * cp
    if shard == -1:
        if gpus % rest:
            raise ValueError(f"[parallelism] data_parallel_shard_degree = -1 takes the ranks "
                             f"left over, but replicate {replicate} x tp {tp} x pp {pp} x cp "
                             f"{cp} = {rest} does not divide the {gpus} GPUs (--gpus)")
        shard = gpus // rest
    elif shard < 1:
        raise ValueError(f"[parallelism] data_parallel_shard_degree must be -1 or at least 1, "
                         f"got {shard}")
    if rest * shard != gpus:
        raise ValueError(f"[parallelism] degrees: replicate {replicate} x shard {shard} x tp "
                         f"{tp} x pp {pp} x cp {cp} = {rest * shard}, not the {gpus} GPUs "
                         f"(--gpus)")
    dp = replicate * shard
    ep = torchtitan_ep(get, facts.experts.count if facts.experts else None, tp, cp, shard, notes)
    zero1 = ours_zero1
    # FSDP (fully_shard per block): weights, gradients and optimizer states sharded over the
    # shard degree x cp (torchtitan's dp_shard_cp mesh, FSDP even at a shard degree of 1),
    # replicated across `replicate` groups (HSDP): fxpar's zero=3, which shards over dp_shard x cp
    zero, dp_shard = (3, shard if replicate > 1 else None) if shard * cp > 1 else (0, None)
    seq = sized("[training] seq_len", _field(data, "training", "seq_len", int), ours_seq,
                 "--seq")
    local = _field(data, "training", "local_batch_size", int)
    if local is None:
        local = _field(data, "training", "batch_size", int)
    total = _field(data, "training", "global_batch_size", int, -1)
    if local is None and total == -1:
        batch = ours_batch or facts.global_batch
        if batch % dp:
            raise ValueError(f"no [training] batch size, and the model's global batch {batch} "
                             f"does not divide over data parallel {dp}")
        local = batch // dp
        notes.append(f"no [training] batch size: priced with the model's global batch {batch}")
    else:
        local = local if local is not None else 8  # torchtitan's default
        batch = total if total != -1 else local * dp
        batch = sized("[training] global_batch_size", batch, ours_batch, "--global-batch")
        if batch % (local * dp):
            raise ValueError(f"[training] global_batch_size {batch} is not a multiple of "
                             f"local_batch_size {local} x data parallel {dp}")
    schedule, v, lengths = _torchtitan_pipeline(data, path, facts.layers, pp, local, batch, dp,
                                                notes)
    if pp > 1:
        mb = get("pipeline_parallel_microbatch_size", int, 1)
        if local is not None and local % mb:
            raise ValueError(f"[parallelism] pipeline_parallel_microbatch_size {mb} does not "
                             f"divide [training] local_batch_size {local}")
        if batch is not None and local is not None and batch > local * dp:
            notes.append(f"gradient accumulation over {batch // (local * dp)} steps: fxpar "
                         f"prices one pipeline of all the micro-batches (one bubble)")
    else:
        mb = local if local is not None else 1
    if batch is None:
        raise ValueError("give a batch size: [training] local_batch_size or --global-batch")
    runtime = _beside_layout(data, tp, shard, notes, ignored)
    if tp > 1 and get("disable_loss_parallel", bool, False):
        notes.append("disable_loss_parallel = true gathers the logits before the loss; priced "
                     "as fxpar's vocabulary-parallel head")
    pattern, recompute = _torchtitan_recompute(data, notes)
    base = str(Strategy(tp > 1, tp > 1))
    stages = with_flags(tuple((base,) * n for n in lengths), tp > 1, tp > 1,
                        pattern_recompute(lengths, pattern, pp))
    config = Configuration(dp, tp, pp, cp, mb, schedule, v, stages,
                           ends="vocab-tp" if tp > 1 else "auto", zero=zero, dp_shard=dp_shard,
                           ep=ep)
    if torchtitan_records(config):  # torch.distributed.pipelining's I and W: fxpar's record
        config = replace(config, split_backward="record")
    elif schedule == "zb-h1":
        notes.append(recorded_with_recompute())
    return Imported("torchtitan", config, seq, batch, zero1, notes, ignored, recompute, runtime)


def _beside_layout(data: dict, tp: int, shard: int, notes: list[str], ignored: list[str]):
    """What the file says beside the layout: compile (the runtime profile to price under,
    returned), low-precision matmuls, async tensor parallelism and the other fields, each a
    note or listed as ignored."""
    compiled = _compiled(data, ignored)
    _low_precision(data, notes, ignored)
    if _field(data, "parallelism", "enable_async_tensor_parallel", bool, False):
        notes.append("enable_async_tensor_parallel = true (tensor-parallel collectives overlapped "
                     "with their matmuls): " + (
                         "not priced: fxpar's torchtitan profiles wait on each tensor-parallel "
                         "collective" if tp > 1 else "no effect at tensor_parallel_degree = 1"))
    if shard > 1 and _field(data, "parallelism", "fsdp_reshard_after_forward", str) == "never":
        notes.append("fsdp_reshard_after_forward = \"never\" keeps the gathered weights from "
                     "forward to backward: priced as FSDP gathering them again")
    if _field(data, "training", "mixed_precision_param", str, "bfloat16") != "bfloat16":
        notes.append(f"[training] mixed_precision_param = "
                     f"\"{data['training']['mixed_precision_param']}\": priced in bfloat16")
    if _field(data, "training", "mixed_precision_reduce", str, "float32") != "float32":
        notes.append(f"[training] mixed_precision_reduce = "
                     f"\"{data['training']['mixed_precision_reduce']}\": priced as fxpar reduces "
                     f"gradients, in float32")
    if _field(data, "training", "enable_cpu_offload", bool, False):
        notes.append("[training] enable_cpu_offload = true: not priced (fxpar keeps the weights "
                     "and optimizer states on the GPU)")
    for section in TORCHTITAN_FIELDS:
        for name in data.get(section, {}):
            if name in NOTED:
                notes.append(f"[{section}] {name}: {NOTED[name]}")
            elif name not in READ:
                ignored.append(f"[{section}] {name}")
    return "torchtitan-compile" if compiled else None


def _compiled(data: dict, ignored: list[str]) -> bool:
    """[compile] enable (with the model among its components), or the older [training]
    compile: torch.compile, which fxpar prices with its torchtitan-compile profile."""
    section = data.get("compile", {})
    if not isinstance(section, dict):
        raise ValueError("[compile] must be a table")
    enable = _field(data, "compile", "enable", bool, False)
    components = _field(data, "compile", "components", list, ["model", "loss"])
    ignored += [f"[compile] {name}" for name in section if name not in ("enable", "components")]
    return (enable and "model" in components) or _field(data, "training", "compile", bool, False)


def _low_precision(data: dict, notes: list[str], ignored: list[str]) -> None:
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ValueError("[model] must be a table")
    converters = _field(data, "model", "converters", list, [])
    low = [c for c in converters if str(c).startswith(LOW_PRECISION)]
    said = [f"[{s}]" for s in LOW_PRECISION if s in data]
    if low:  # a section configures its converter; without one in converters it does nothing
        notes.append(f"[model] converters = {json.dumps(low)}{' with ' if said else ''}"
                     f"{', '.join(said)}: low-precision (float8/MX) matmuls are not priced: fxpar "
                     f"prices them in bf16")
    else:
        ignored += [f"{s} (no [model] converters enable it)" for s in said]
    if set(converters) - set(low):
        notes.append(f"[model] converters {json.dumps(sorted(set(converters) - set(low)))}: "
                     f"not priced")
    other = [name for name in model if name != "converters"]
    if other:
        ignored.append(f"[model] {', '.join(other)} (the model comes from --model/--hf-config)")


def _torchtitan_pipeline(data, path, layers, pp, local, batch, dp, notes):
    """(fxpar schedule, v, blocks per stage)."""
    get = lambda name, kind, default=None: _field(data, "parallelism", name, kind,  # noqa: E731
                                                  default)
    if pp == 1:
        return "1f1b", 1, [layers]
    name = get("pipeline_parallel_schedule", str, "1F1B")
    key = name.lower()
    csv_path = get("pipeline_parallel_schedule_csv", str, "") or ""
    points = get("pipeline_parallel_split_points", list)
    parts = get("module_fqns_per_model_part", list)
    if points and parts:
        raise ValueError("[parallelism] pipeline_parallel_split_points contradicts "
                         "module_fqns_per_model_part: give one")
    lengths = None
    if points:
        lengths = _split_points(points, layers)
    elif parts:
        lengths = _model_parts(parts, layers)
    if csv_path:
        if key not in ("pipelineschedulesingle", "pipelineschedulemulti"):
            raise ValueError(f"[parallelism] pipeline_parallel_schedule = {name!r} with a "
                             f"schedule CSV: torchtitan takes PipelineScheduleSingle or "
                             f"PipelineScheduleMulti there")
    elif key in ("pipelineschedulesingle", "pipelineschedulemulti"):
        raise ValueError(f"[parallelism] pipeline_parallel_schedule = {name!r} needs "
                         f"pipeline_parallel_schedule_csv")
    elif key not in TORCHTITAN_SCHEDULES:
        raise ValueError(f"[parallelism] pipeline_parallel_schedule = {name!r}: fxpar has no "
                         f"such schedule (it prices 1F1B, GPipe, Interleaved1F1B, and zb-h1 "
                         f"given as a CSV)")
    single = key in SINGLE_STAGE
    if lengths is None:
        lps = get("pipeline_parallel_layers_per_stage", int)
        stages = pp * (1 if single else 2) if lps is None else _stages_of(lps, layers, pp,
                                                                          single)
        lengths = [len(s) for s in even_stages(layers, stages, "none")]
        notes.append(f"no split points: priced with the {layers} layers spread evenly over "
                     f"{stages} stages (torchtitan's own default split depends on its version)")
    if len(lengths) % pp:
        raise ValueError(f"[parallelism] the split makes {len(lengths)} stages, not a multiple "
                         f"of pipeline_parallel_degree {pp}")
    v = len(lengths) // pp
    if single and v != 1:
        raise ValueError(f"[parallelism] pipeline_parallel_schedule = {name!r} runs one stage "
                         f"per rank, but the split makes {len(lengths)} stages for {pp} ranks")
    if not single and not csv_path and v < 2:
        raise ValueError(f"[parallelism] pipeline_parallel_schedule = {name!r} runs several "
                         f"stages per rank, but the split makes {len(lengths)} stages for {pp} "
                         f"ranks")
    if csv_path:
        if batch is None or local is None:
            raise ValueError("a schedule CSV needs [training] local_batch_size")
        mb = get("pipeline_parallel_microbatch_size", int, 1)
        return _csv_schedule(csv_path, path, pp, (batch // dp) // mb, v), v, lengths
    return TORCHTITAN_SCHEDULES[key], v, lengths


def _stages_of(per_stage: int, layers: int, pp: int, single: bool) -> int:
    """torchtitan's stage count for pipeline_parallel_layers_per_stage: the layers with the
    embedding and the output counted as one layer each, ceil((layers + 2) / per_stage); a
    count that is no multiple of the pipeline degree says which values would be."""
    def count(n: int) -> int:
        return -(-(layers + 2) // n)

    stages = count(per_stage)
    if stages % pp == 0 and (not single or stages == pp):
        return stages
    # the values whose count this schedule runs: pp stages, or at least two per rank
    fits = [n for n in range(1, layers + 3) if count(n) % pp == 0 and
            (count(n) == pp if single else count(n) >= 2 * pp)]
    near = sorted(fits, key=lambda n: (abs(n - per_stage), n))[:2]
    hint = (f"; try {' or '.join(map(str, sorted(near)))}" if near else
            "; give pipeline_parallel_split_points instead")
    raise ValueError(f"[parallelism] pipeline_parallel_layers_per_stage {per_stage} makes "
                     f"ceil(({layers} layers + 2) / {per_stage}) = {stages} stages, not "
                     f"{'the' if single else 'a multiple of the'} pipeline_parallel_degree {pp}"
                     f"{' (the schedule runs one stage per rank)' if single else ''}{hint}")


def _split_points(points: list, layers: int) -> list[int]:
    where = "[parallelism] pipeline_parallel_split_points"
    firsts = []
    for p in points:
        m = re.fullmatch(r"layers\.(\d+)", p) if isinstance(p, str) else None
        if m is None or not 0 <= int(m.group(1)) < layers:
            raise ValueError(f"{where}: {p!r} is not a layer 'layers.K' with K in 0..{layers - 1}")
        firsts.append(int(m.group(1)))
    if firsts != sorted(set(firsts)):
        raise ValueError(f"{where}: the split points must increase, got {points}")
    bounds = [0, *firsts, layers]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _model_parts(parts: list, layers: int) -> list[int]:
    where = "[parallelism] module_fqns_per_model_part"
    seen, lengths = [], []
    for part in parts:
        if not isinstance(part, list):
            raise ValueError(f"{where}: each model part is a list of module names, got {part!r}")
        count = 0
        for name in part:
            m = re.fullmatch(r"layers\.(\d+)", name) if isinstance(name, str) else None
            if m:
                seen.append(int(m.group(1)))
                count += 1
            elif name not in ("tok_embeddings", "norm", "output"):
                raise ValueError(f"{where}: unknown module {name!r}")
        lengths.append(count)
    if seen != list(range(layers)):
        raise ValueError(f"{where}: the parts must hold layers.0 to layers.{layers - 1} once each, "
                         f"in order")
    return lengths


def _csv_schedule(csv_path: str, toml_path: str, pp: int, m: int, v: int) -> str:
    """Which of fxpar's schedules a torch.distributed.pipelining compute CSV is."""
    where = "[parallelism] pipeline_parallel_schedule_csv"
    candidates = [csv_path, os.path.join(os.path.dirname(os.path.abspath(toml_path)), csv_path)]
    found = next((p for p in candidates if os.path.isfile(p)), None)
    if found is None:
        raise ValueError(f"{where}: no file {csv_path!r} (looked here and beside {toml_path})")
    with open(found, encoding="utf-8") as f:
        rows = [",".join(c.strip() for c in line.split(",")) for line in f.read().splitlines()]
    rows = [r for r in rows if r]
    for name in ("zb-h1", "1f1b", "gpipe", "interleaved-1f1b"):
        if (name == "interleaved-1f1b") != (v > 1):
            continue
        try:
            ours = schedule_csv(name, pp, m, v).splitlines()
        except ValueError:
            continue
        if ours == rows:
            return name
    raise ValueError(f"{where}: {found} is none of fxpar's schedules (1f1b, gpipe, "
                     f"interleaved-1f1b, zb-h1) for {pp} ranks and {m} micro-batches")


def _torchtitan_recompute(data: dict, notes: list[str]) -> tuple[tuple, str]:
    section = data.get("activation_checkpoint")
    if section is None:
        notes.append("no [activation_checkpoint]: torchtitan's default, mode = \"selective\" "
                     "with selective_ac_option = \"2\" (every 2nd layer fully recomputed)")
    mode = _field(data, "activation_checkpoint", "mode", str, "selective")
    option = _field(data, "activation_checkpoint", "selective_ac_option", None, "2")
    where = "[activation_checkpoint]"
    if mode == "none":
        return ("uniform", "none"), "none"
    if mode == "full":
        return ("uniform", "full"), "full on every layer"
    if mode != "selective":
        raise ValueError(f"{where} mode = {mode!r}: torchtitan knows none, selective and full")
    if option == "op":
        notes.append("selective_ac_option = \"op\" (per-op: element-wise work recomputed, "
                     "matmul and attention outputs kept): priced as fxpar's selective "
                     "(attention core recomputed), the nearest")
        return ("uniform", "selective"), "selective (per op)"
    text = str(option)
    if isinstance(option, bool) or not text.isdigit():
        raise ValueError(f"{where} selective_ac_option = {option!r}: torchtitan takes 'op' or "
                         f"an integer n (every n-th layer)")
    n = int(text)
    if n <= 1:
        return ("uniform", "full"), "full on every layer"
    return ("every", n), f"full on one layer in {n} of each rank"
