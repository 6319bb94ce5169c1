"""`fxpar plan --from-megatron "FLAGS"` and `--from-torchtitan FILE.toml`: price a configuration
written for another framework with fxpar's cost model, beside fxpar's own plan.

The flags or fields become a `planner.pricing.Configuration`: the mesh, micro-batch and schedule
fixed as `--fix` would fix them (the same checks and refusals), and the stage layout the framework
would build: Megatron-LM's even split, `--decoder-first/last-pipeline-num-layers`, the
`--account-for-*-in-pipeline-split` slots or `--pipeline-model-parallel-layout`; torchtitan's
`pipeline_parallel_split_points` or `module_fqns_per_model_part`, else the layers spread evenly.
Recomputation is placed per layer as the framework places it (Megatron's block method: the first
k layers of each stage; torchtitan's integer option: every n-th layer of a rank).

The model comes from --model (with fxpar's size flags) or --hf/--hf-config. Flags that describe
the model (--num-layers, --hidden-size, --ffn-hidden-size, --num-attention-heads,
--num-query-groups, --vocab-size, --swiglu, --normalization, --position-embedding-type) must
agree with it: a contradiction is an error naming the flag. Flags that size the training run
(--seq-length, --global-batch-size; torchtitan's seq_len and batch sizes) set it, unless fxpar's
own --seq or --global-batch says otherwise (an error). Flags that do not change the price
(learning rate, data paths, logging, ...) are listed as ignored; any other flag is an error
naming it. Every error is one line, exit status 2.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
from dataclasses import dataclass, field

from cost_model.strategy import Strategy
from planner.emit import (ModelFacts, cmd_emit, model_of_args, pattern_recompute, pricer_of_args,
                          schedule_csv, with_flags)
from planner.explain import binding_constraint, diff, explain
from planner.pricing import Configuration, compare, even_stages


@dataclass
class Imported:
    """A configuration read from another framework and what it says about the run."""
    source: str                                  # "Megatron-LM" or "torchtitan"
    config: Configuration
    seq: int | None = None                       # the run's sequence length, if it sets one
    global_batch: int | None = None
    zero1: bool = False
    notes: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    recompute: str = "none"                      # how the source states it, for the summary


def _positive(flag: str, value, what: str = "a positive integer") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            not str(value).strip().isdigit() or int(value) < 1:
        raise ValueError(f"{flag}: expected {what}, got {value!r}")
    return int(value)


def _agree(flag: str, given, model_value, facts: ModelFacts, what: str) -> None:
    if given is not None and given != model_value:
        raise ValueError(f"{flag} {given} contradicts the model {facts.name}, whose {what} is "
                         f"{model_value} (the model comes from --model/--hf-config)")


def _sized(flag: str, given: int | None, ours: int | None, ours_flag: str) -> int | None:
    if given is not None and ours is not None and given != ours:
        raise ValueError(f"{flag} {given} contradicts {ours_flag} {ours}")
    return given if given is not None else ours


# --------------------------------------------------------------------------------------------
# Megatron-LM
# --------------------------------------------------------------------------------------------
INT, STR, SWITCH, LIST = "int", "str", "switch", "list"
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size": INT, "--pipeline-model-parallel-size": INT,
    "--context-parallel-size": INT, "--num-layers-per-virtual-pipeline-stage": INT,
    "--num-virtual-stages-per-pipeline-rank": INT, "--pipeline-model-parallel-layout": STR,
    "--decoder-first-pipeline-num-layers": INT, "--decoder-last-pipeline-num-layers": INT,
    "--account-for-embedding-in-pipeline-split": SWITCH,
    "--account-for-loss-in-pipeline-split": SWITCH, "--sequence-parallel": SWITCH,
    "--recompute-activations": SWITCH, "--recompute-granularity": STR,
    "--recompute-method": STR, "--recompute-num-layers": INT, "--recompute-modules": LIST,
    "--micro-batch-size": INT, "--global-batch-size": INT, "--use-distributed-optimizer": SWITCH,
    "--num-layers": INT, "--hidden-size": INT, "--ffn-hidden-size": INT,
    "--num-attention-heads": INT, "--group-query-attention": SWITCH, "--num-query-groups": INT,
    "--seq-length": INT, "--max-position-embeddings": INT, "--vocab-size": INT,
    "--swiglu": SWITCH, "--normalization": STR, "--position-embedding-type": STR,
    "--use-rotary-position-embeddings": SWITCH, "--untie-embeddings-and-output-weights": SWITCH,
    "--disable-bias-linear": SWITCH, "--bf16": SWITCH, "--fp16": SWITCH,
    "--expert-model-parallel-size": INT, "--num-experts": INT,
}
# Flags that do not change what fxpar prices (optimizer settings, data, logging, checkpoints,
# kernels and overlaps fxpar's cost model does not distinguish).
MEGATRON_IGNORED = frozenset("""
--lr --min-lr --lr-decay-style --lr-warmup-fraction --lr-warmup-iters --lr-warmup-samples
--lr-decay-iters --lr-decay-samples --weight-decay --clip-grad --adam-beta1 --adam-beta2
--adam-eps --init-method-std --train-iters --train-samples --eval-iters --eval-interval
--log-interval --save-interval --save --load --data-path --split --vocab-file --merge-file
--tokenizer-type --tokenizer-model --seed --attention-dropout --hidden-dropout
--transformer-impl --make-vocab-size-divisible-by --distributed-backend --tensorboard-dir
--wandb-project --wandb-exp-name --exit-interval --ckpt-format --num-workers --data-cache-path
--attention-backend --distributed-timeout-minutes --rotary-base --norm-epsilon --use-flash-attn
--use-mcore-models --overlap-grad-reduce --overlap-param-gather --mock-data
--no-masked-softmax-fusion --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32
--no-gradient-accumulation-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
--no-bias-swiglu-fusion --no-rope-fusion --log-throughput --use-cpu-initialization
--tp-comm-overlap --cross-entropy-loss-fusion --manual-gc --no-load-optim --no-load-rng
--no-save-optim --no-save-rng --finetune --log-timers-to-tensorboard --log-params-norm
--log-num-zeros-in-grad --timing-log-level --tensorboard-log-interval --eval-only
--lr-wsd-decay-style --lr-wsd-decay-iters --weight-decay-incr-style --start-weight-decay
--end-weight-decay --loss-scale --initial-loss-scale --hysteresis --min-loss-scale
--ddp-bucket-size --ddp-num-buckets --align-grad-reduce --overlap-p2p-communication
--no-overlap-p2p-communication --ddp-average-in-collective --grad-reduce-in-bf16
""".split())


def _megatron_tokens(text: str) -> list[str]:
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as err:
        raise ValueError(f"--from-megatron: cannot split the flags: {err}") from None
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    if script is not None:  # `torchrun ... pretrain_gpt.py --flags`: the script's flags only
        tokens = tokens[script + 1:]
    if tokens and not tokens[0].startswith("--"):
        raise ValueError(f"--from-megatron: expected Megatron-LM flags (--name value ...), got "
                         f"{tokens[0]!r}")
    return tokens


def read_megatron_flags(text: str) -> tuple[dict, list[str]]:
    """{flag: value} (True for a switch, a list for --recompute-modules) and the ignored flags;
    an unknown flag, a missing value or a flag given twice is an error naming it."""
    tokens = _megatron_tokens(text)
    values, ignored, i = {}, [], 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ValueError(f"--from-megatron: {token!r} follows no flag that takes it")
        name, eq, inline = token.partition("=")
        kind = MEGATRON_FLAGS.get(name)
        if kind is None:
            if name not in MEGATRON_IGNORED:
                raise ValueError(f"unknown Megatron-LM flag {name} (fxpar reads the parallel, "
                                 f"batch, recompute and model-size flags and ignores optimizer, "
                                 f"data and logging ones)")
            ignored.append(name)
            i += 1
            while i < len(tokens) and not tokens[i].startswith("--"):
                i += 1
            continue
        i += 1
        if kind == SWITCH:
            if eq:
                raise ValueError(f"{name} is a switch and takes no value, got {inline!r}")
            value = True
        elif kind == LIST:
            value = [inline] if eq else []
            while i < len(tokens) and not tokens[i].startswith("--"):
                value.append(tokens[i])
                i += 1
        else:
            if eq:
                value = inline
            elif i < len(tokens) and not tokens[i].startswith("--"):
                value, i = tokens[i], i + 1
            else:
                raise ValueError(f"{name} needs a value")
            if kind == INT:
                value = _positive(name, value)
        if name in values and values[name] != value:
            raise ValueError(f"{name} is given twice ({values[name]!r} and {value!r})")
        values[name] = value
    return values, ignored


def parse_layout(text: str, layers: int, pp: int) -> list[int]:
    """Blocks per stage of --pipeline-model-parallel-layout, as Megatron-LM reads it: commas
    are cosmetic, "(...)*n" and "x*n" repeat, "|" splits stages; E (embedding) opens the first
    stage, L (loss) closes the last, t is a transformer layer."""
    flag = "--pipeline-model-parallel-layout"
    s = text.replace(",", "")
    if re.search(r"[^ELtm|()*\d]", s):
        raise ValueError(f"{flag} {text!r}: only E, L, t, |, (, ), * and digits may appear")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    if re.search(r"[()*\d]", s):
        raise ValueError(f"{flag} {text!r}: a repeat is malformed")
    stages = s.split("|")
    if "m" in s:
        raise ValueError(f"{flag} {text!r}: multi-token prediction layers (m) are not something "
                         f"fxpar prices")
    if s.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"{flag} {text!r}: the embedding E must open the first stage, once")
    if s.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"{flag} {text!r}: the loss L must close the last stage, once")
    counts = [st.count("t") for st in stages]
    if sum(counts) != layers:
        raise ValueError(f"{flag} {text!r} places {sum(counts)} transformer layers; the model "
                         f"has {layers}")
    if len(stages) % pp:
        raise ValueError(f"{flag} {text!r} has {len(stages)} stages, not a multiple of "
                         f"--pipeline-model-parallel-size {pp}")
    return counts


def _slots(layers: int, stages: int, embed: bool, loss: bool, why: str) -> list[int]:
    """Megatron's even split, the embedding and loss counted as a layer when accounted for."""
    total = layers + embed + loss
    counted = " and ".join(w for w, on in (("the embedding", embed), ("the loss", loss)) if on)
    if total % stages:
        raise ValueError(f"{why}: {layers} layers{' with ' + counted if counted else ''} do not "
                         f"split evenly over {stages} stages")
    counts = [total // stages] * stages
    counts[0] -= embed
    counts[-1] -= loss
    if min(counts) < 0:
        raise ValueError(f"{why}: a stage would hold fewer than no layers")
    return counts


def megatron_configuration(text: str, facts: ModelFacts, gpus: int, ours_seq=None,
                           ours_batch=None, ours_zero1=False) -> Imported:
    f, ignored = read_megatron_flags(text)
    notes: list[str] = []
    _megatron_model_checks(f, facts, notes)
    if f.get("--expert-model-parallel-size", 1) > 1 or "--num-experts" in f:
        flag = "--num-experts" if "--num-experts" in f else "--expert-model-parallel-size"
        raise ValueError(f"{flag}: fxpar plans dense models (no experts)")
    tp = f.get("--tensor-model-parallel-size", 1)
    pp = f.get("--pipeline-model-parallel-size", 1)
    cp = f.get("--context-parallel-size", 1)
    if gpus % (tp * pp * cp):
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
                         f"{pp} x --context-parallel-size {cp} = {tp * pp * cp} does not divide "
                         f"the {gpus} GPUs (--gpus)")
    dp = gpus // (tp * pp * cp)
    if "--micro-batch-size" not in f:
        raise ValueError("--micro-batch-size is missing (Megatron-LM requires it)")
    mb = f["--micro-batch-size"]
    seq = _sized("--seq-length", f.get("--seq-length"), ours_seq, "--seq")
    if "--max-position-embeddings" in f and seq is not None and \
            f["--max-position-embeddings"] < seq:
        raise ValueError(f"--max-position-embeddings {f['--max-position-embeddings']} is below "
                         f"the sequence length {seq}")
    batch = _sized("--global-batch-size", f.get("--global-batch-size"), ours_batch,
                   "--global-batch")
    if batch is None:
        batch = mb * dp
        notes.append(f"no --global-batch-size: Megatron-LM's default, --micro-batch-size x data "
                     f"parallel = {batch}")
    if batch % (mb * dp):
        raise ValueError(f"--global-batch-size {batch} is not a multiple of --micro-batch-size "
                         f"{mb} x data-parallel size {dp} (= {gpus} GPUs / tp {tp} / pp {pp} / "
                         f"cp {cp})")
    lengths = _megatron_stages(f, facts.layers, pp)
    v = len(lengths) // pp
    sp = bool(f.get("--sequence-parallel")) and tp > 1
    if f.get("--sequence-parallel") and tp == 1:
        notes.append("Megatron-LM turns --sequence-parallel off at tp=1")
    pattern, recompute = _megatron_recompute(f, notes)
    base = str(Strategy(tp > 1, sp))
    stages = with_flags(tuple((base,) * n for n in lengths), tp > 1, sp,
                        pattern_recompute(lengths, pattern, pp))
    zero1 = bool(f.get("--use-distributed-optimizer"))
    if ours_zero1 and not zero1:
        raise ValueError("--zero1 contradicts the Megatron-LM flags, which lack "
                         "--use-distributed-optimizer")
    if zero1 and not ours_zero1:
        notes.append("--use-distributed-optimizer: both priced with ZeRO-1 (optimizer states "
                     "sharded over data parallel), as --zero1")
    sixteen = bool(f.get("--bf16") or f.get("--fp16"))
    if sixteen != (facts.dtype_bytes == 2):
        notes.append(f"{'--bf16/--fp16' if sixteen else 'without --bf16 or --fp16 (fp32)'}: "
                     f"priced in the model's own {8 * facts.dtype_bytes}-bit precision")
    config = Configuration(dp, tp, pp, cp, mb, "interleaved-1f1b" if v > 1 else "1f1b", v,
                           stages, ends="vocab-tp" if tp > 1 else "auto")
    return Imported("Megatron-LM", config, seq, batch, zero1 or ours_zero1, notes, ignored,
                    recompute)


def _megatron_model_checks(f: dict, facts: ModelFacts, notes: list[str]) -> None:
    _agree("--num-layers", f.get("--num-layers"), facts.layers, facts, "number of layers")
    _agree("--hidden-size", f.get("--hidden-size"), facts.hidden, facts, "hidden size")
    _agree("--ffn-hidden-size", f.get("--ffn-hidden-size"), facts.ffn, facts, "MLP width")
    _agree("--num-attention-heads", f.get("--num-attention-heads"), facts.heads, facts,
           "number of attention heads")
    if "--num-query-groups" in f or f.get("--group-query-attention"):
        groups = f.get("--num-query-groups", 1) if f.get("--group-query-attention") else \
            facts.heads
        _agree("--num-query-groups", groups, facts.kv_heads, facts, "number of key/value heads")
    _agree("--vocab-size", f.get("--vocab-size"), facts.vocab, facts, "vocabulary")
    llama = facts.arch == "llama"
    if f.get("--swiglu") and not llama:
        raise ValueError(f"--swiglu contradicts the model {facts.name}, whose MLP is GELU")
    norm = f.get("--normalization")
    if norm is not None and norm not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization {norm!r}: Megatron-LM knows LayerNorm and RMSNorm")
    if norm is not None and (norm == "RMSNorm") != llama:
        raise ValueError(f"--normalization {norm} contradicts the model {facts.name}, which "
                         f"uses {'RMSNorm' if llama else 'LayerNorm'}")
    position = f.get("--position-embedding-type")
    if f.get("--use-rotary-position-embeddings"):
        position = "rope"
    if position is not None and (position == "rope") != llama:
        raise ValueError(f"--position-embedding-type {position} contradicts the model "
                         f"{facts.name}, which uses "
                         f"{'rotary' if llama else 'learned absolute'} positions")
    if "--num-layers" in f and f.get("--untie-embeddings-and-output-weights") == facts.tie:
        notes.append(f"the flags {'untie' if not facts.tie else 'tie'} the embedding and output "
                     f"weights, the model {facts.name} does not: priced as the model")


def _megatron_stages(f: dict, layers: int, pp: int) -> list[int]:
    vflags = [k for k in ("--num-layers-per-virtual-pipeline-stage",
                          "--num-virtual-stages-per-pipeline-rank",
                          "--pipeline-model-parallel-layout") if k in f]
    if len(vflags) > 1:
        raise ValueError(f"{vflags[0]} and {vflags[1]} are exclusive (Megatron-LM accepts one)")
    embed = bool(f.get("--account-for-embedding-in-pipeline-split"))
    loss = bool(f.get("--account-for-loss-in-pipeline-split"))
    first, last = (f.get("--decoder-first-pipeline-num-layers"),
                   f.get("--decoder-last-pipeline-num-layers"))
    if "--pipeline-model-parallel-layout" in f:
        for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"):
            if flag in f:
                raise ValueError(f"{flag} contradicts --pipeline-model-parallel-layout, which "
                                 f"places every layer")
        return parse_layout(f["--pipeline-model-parallel-layout"], layers, pp)
    if first is not None or last is not None:
        if vflags or embed or loss:
            other = vflags[0] if vflags else ("--account-for-embedding-in-pipeline-split" if embed
                                              else "--account-for-loss-in-pipeline-split")
            raise ValueError(f"--decoder-first/last-pipeline-num-layers with {other}: give the "
                             f"stages as --pipeline-model-parallel-layout")
        ends = (first or 0) + (last or 0)
        middle = pp - (first is not None) - (last is not None)
        rest = layers - ends
        if rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise ValueError(f"--decoder-first/last-pipeline-num-layers {first}/{last} leave "
                             f"{rest} layers for {middle} middle stages of "
                             f"--pipeline-model-parallel-size {pp}")
        each = rest // middle if middle else 0
        counts = [each] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    v = 1
    if "--num-virtual-stages-per-pipeline-rank" in f:
        v = f["--num-virtual-stages-per-pipeline-rank"]
    elif "--num-layers-per-virtual-pipeline-stage" in f:
        _slots(layers, pp, embed, loss, "--num-layers and --pipeline-model-parallel-size")
        per_rank = (layers + embed + loss) // pp
        per = f["--num-layers-per-virtual-pipeline-stage"]
        if per_rank % per:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per} does not divide "
                             f"the {per_rank} layers of each pipeline rank")
        v = per_rank // per
    if v > 1 and pp == 1:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    return _slots(layers, pp * v, embed, loss, "--num-layers and --pipeline-model-parallel-size")


def _megatron_recompute(f: dict, notes: list[str]) -> tuple[tuple, str]:
    granularity = f.get("--recompute-granularity")
    if granularity is not None and granularity not in ("full", "selective"):
        raise ValueError(f"--recompute-granularity {granularity!r}: Megatron-LM knows full and "
                         f"selective")
    if f.get("--recompute-activations"):
        if granularity == "full":
            raise ValueError("--recompute-activations (selective) contradicts "
                             "--recompute-granularity full")
        granularity = "selective"
    method, layers = f.get("--recompute-method"), f.get("--recompute-num-layers")
    if method is not None and method not in ("uniform", "block"):
        raise ValueError(f"--recompute-method {method!r}: Megatron-LM knows uniform and block")
    modules = f.get("--recompute-modules")
    if modules is not None and set(modules) - {"core_attn"}:
        other = sorted(set(modules) - {"core_attn"})
        raise ValueError(f"--recompute-modules {' '.join(other)}: fxpar's selective "
                         f"recomputation is the core attention's (core_attn)")
    if granularity == "selective":
        if method is not None:
            raise ValueError("--recompute-method contradicts --recompute-granularity selective "
                             "(Megatron-LM takes a method for full recomputation only)")
        return ("uniform", "selective"), "selective (core attention)"
    if granularity == "full":
        if method is None:
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or "
                             "block")
        if layers is None:
            raise ValueError("--recompute-granularity full needs --recompute-num-layers")
        if method == "uniform":
            if layers > 1:
                notes.append(f"--recompute-method uniform --recompute-num-layers {layers}: fxpar "
                             f"prices a checkpoint per layer (Megatron-LM keeps one per "
                             f"{layers} layers)")
            return ("uniform", "full"), "full on every layer"
        first = "layer" if layers == 1 else f"{layers} layers"
        return ("block", layers), f"full on the first {first} of each stage"
    if method is not None or layers is not None:
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        raise ValueError(f"{flag} needs --recompute-granularity full")
    return ("uniform", "none"), "none"


# --------------------------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------------------------
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
TORCHTITAN_IGNORED = {"job", "profiling", "metrics", "model", "optimizer", "lr_scheduler",
                      "checkpoint", "float8", "mx", "comm", "memory_estimation",
                      "fault_tolerance", "experimental", "validation", "compile", "quantize"}
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
    ignored = []
    for section, body in data.items():
        if section in TORCHTITAN_IGNORED:
            ignored.append(f"[{section}]")
            continue
        if section not in TORCHTITAN_FIELDS:
            raise ValueError(f"unknown torchtitan section [{section}] in {path}")
        if not isinstance(body, dict):
            raise ValueError(f"[{section}] in {path} must be a table")
        for name in body:
            if name not in TORCHTITAN_FIELDS[section]:
                raise ValueError(f"unknown torchtitan field [{section}] {name} in {path}")
    if any(k in data for k in ("float8", "mx")):
        notes.append("[float8]/[mx]: low-precision matmuls are not priced (fxpar prices bf16)")
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
    if get("expert_parallel_degree", int, 1) > 1:
        raise ValueError("[parallelism] expert_parallel_degree: fxpar plans dense models (no "
                         "experts)")
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
    zero1 = ours_zero1
    if shard > 1:
        zero1 = True
        notes.append(f"data_parallel_shard_degree = {shard}: FSDP, which fxpar does not model; "
                     f"priced as {dp} data-parallel replicas with ZeRO-1 (optimizer states "
                     f"sharded), the nearest fxpar prices, for both")
    if cp > 1:
        notes.append(f"torchtitan shards the weights (FSDP) over the {cp} context-parallel "
                     f"ranks; fxpar prices them replicated")
    seq = _sized("[training] seq_len", _field(data, "training", "seq_len", int), ours_seq,
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
        batch = _sized("[training] global_batch_size", batch, ours_batch, "--global-batch")
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
    if tp > 1 and get("disable_loss_parallel", bool, False):
        notes.append("disable_loss_parallel = true gathers the logits before the loss; priced "
                     "as fxpar's vocabulary-parallel head")
    pattern, recompute = _torchtitan_recompute(data, notes)
    base = str(Strategy(tp > 1, tp > 1))
    stages = with_flags(tuple((base,) * n for n in lengths), tp > 1, tp > 1,
                        pattern_recompute(lengths, pattern, pp))
    config = Configuration(dp, tp, pp, cp, mb, schedule, v, stages,
                           ends="vocab-tp" if tp > 1 else "auto")
    return Imported("torchtitan", config, seq, batch, zero1, notes, ignored, recompute)


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
        stages = pp * (1 if single else 2) if lps is None else -(-(layers + 2) // lps)
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


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------
def _describe(imp: Imported) -> str:
    c = imp.config
    lengths = [len(s) for s in c.stages]
    split = (f"{lengths[0]} layers per stage" if len(set(lengths)) == 1
             else "layers per stage " + " ".join(map(str, lengths)))
    tp = "none" if c.tp == 1 else "tp+sp" if all(Strategy.parse(s).sp for st in c.stages
                                                  for s in st) else "tp"
    v = f" v={c.v}" if c.v > 1 else ""
    return (f"{imp.source} configuration: dp={c.dp} tp={c.tp} pp={c.pp} cp={c.cp}, "
            f"{c.schedule}{v}, micro-batch {c.micro_batch}, {split}, layers {tp}, "
            f"recomputation {imp.recompute} (as --fix {c.fix_text()}, the stages as given)")


def cmd_import(args) -> int:
    _, _, facts = model_of_args(args)
    if args.from_torchtitan:
        imp = torchtitan_configuration(args.from_torchtitan, facts, args.gpus, args.seq,
                                       args.global_batch, args.zero1)
    else:
        imp = megatron_configuration(args.from_megatron, facts, args.gpus, args.seq,
                                     args.global_batch, args.zero1)
    pricer, _ = pricer_of_args(args, seq=imp.seq, global_batch=imp.global_batch, zero1=imp.zero1)
    theirs = pricer.price(imp.config)
    plans = pricer.best(top_k=args.top_k if args.explain else 1, fix=args.fix)
    ours = plans[0]
    print(_describe(imp))
    for note in imp.notes:
        print(f"note: {note}")
    if imp.ignored:
        print(f"ignored (no effect on fxpar's price): {', '.join(imp.ignored)}")
    print()
    table = diff(theirs.plan, ours, (imp.source, "fxpar"))
    print("fxpar's plan is this configuration" if table == "the plans are identical" else table)
    print()
    print(compare(ours, theirs, f"{imp.source} configuration"))
    print(f"binding constraint of the {imp.source} configuration: "
          f"{binding_constraint(theirs.plan)}")
    print(f"binding constraint of fxpar's plan: {binding_constraint(ours)}")
    if args.explain:
        print()
        print(explain(plans))
    return 0


def cmd_portable(args, build_config, build_hf) -> int:
    """--emit, --from-megatron and --from-torchtitan (one at a time); `build_config(args)` and
    `build_hf(args)` make the model from fxpar's own flags, as `fxpar plan` does."""
    args = argparse.Namespace(**{**vars(args), "build_config": build_config,
                                 "build_hf": build_hf})
    given = [flag for flag, on in (("--emit", args.emit),
                                   ("--from-megatron", args.from_megatron is not None),
                                   ("--from-torchtitan", args.from_torchtitan)) if on]
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]} are exclusive: give one")
    for flag, on in (("--json", args.json), ("--png", args.png)):
        if on:
            raise ValueError(f"{flag} does not go with {given[0]}")
    if args.emit:
        return cmd_emit(args)
    return cmd_import(args)
