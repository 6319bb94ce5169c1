"""Megatron-LM command-line flags as a `planner.interop.configuration.Configuration` (see planner.interop.price_imported):
the mesh, micro-batching and schedule, Megatron's stage split or layout, and its recomputation;
expert parallelism as planner.interop.expert_layout reads it; the flags that define the model
checked against it (planner.interop.megatron_model)."""
from __future__ import annotations

import os
import re
import shlex

from cost_model.layers.strategy import Strategy
from planner.interop import megatron_moe as moe
from planner.interop.expert_layout import megatron_ep
from planner.interop.megatron_model import VOCAB_DIVISOR, vocab_padding_note
from planner.interop.megatron_model import check as model_check
from planner.interop.model_facts import ModelFacts
from planner.interop.recompute_patterns import pattern_recompute, with_flags
from planner.interop.readers import Imported, positive, sized
from planner.interop.configuration import Configuration


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
    "--make-vocab-size-divisible-by": INT,
    "--swiglu": SWITCH, "--normalization": STR, "--position-embedding-type": STR,
    "--use-rotary-position-embeddings": SWITCH, "--untie-embeddings-and-output-weights": SWITCH,
    "--disable-bias-linear": SWITCH, "--bf16": SWITCH, "--fp16": SWITCH,
    "--add-qkv-bias": SWITCH, "--rotary-base": STR, "--norm-epsilon": STR,
    "--use-megatron-fsdp": SWITCH, "--data-parallel-sharding-strategy": STR,
    "--expert-model-parallel-size": INT, "--expert-tensor-parallel-size": INT,
    "--num-experts": INT,
    # the model's definition beyond its sizes (planner.interop.megatron_model checks them)
    "--kv-channels": INT, "--qk-layernorm": SWITCH, "--rotary-percent": STR,
    "--squared-relu": SWITCH, "--openai-gelu": SWITCH, "--quick-geglu": SWITCH,
    "--apply-layernorm-1p": SWITCH, "--window-size": STR, "--window-attn-skip-freq": STR,
    "--use-rope-scaling": SWITCH, "--rope-scaling-factor": STR, "--no-position-embedding": SWITCH,
    # other names of the stage flags above (ALIASES)
    "--virtual-pipeline-model-parallel-size": INT, "--num-layers-in-first-pipeline-stage": INT,
    "--num-layers-in-last-pipeline-stage": INT,
    # numerics that leave the model and its price as they are (NUMERICS says why)
    "--apply-query-key-layer-scaling": SWITCH, "--rotary-interleaved": SWITCH,
    # experts and latent attention (planner.interop.megatron_moe checks them)
    **{flag: INT for flag in moe.INT_FLAGS}, **{flag: STR for flag in moe.STR_FLAGS},
    **{flag: SWITCH for flag in moe.SWITCHES},
}
# Names of one setting: Megatron-LM's older or newer flag -> the one read here
ALIASES = {"--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank",
           "--num-layers-in-first-pipeline-stage": "--decoder-first-pipeline-num-layers",
           "--num-layers-in-last-pipeline-stage": "--decoder-last-pipeline-num-layers"}
NUMERICS = {
    "--apply-query-key-layer-scaling": "scales the attention scores down by the layer number "
                                       "(fp16 range) and back up in the softmax: the same model; "
                                       "not priced differently",
    "--rotary-interleaved": "rotates interleaved pairs of each head's dimensions: not checked "
                            "against the model (fxpar does not read which dimensions its rotary "
                            "pairs); not priced differently",
}
# Flags that do not change what fxpar prices (optimizer settings, data, logging, checkpoints,
# kernels and overlaps fxpar's cost model does not distinguish).
MEGATRON_IGNORED = frozenset("""
--lr --min-lr --lr-decay-style --lr-warmup-fraction --lr-warmup-iters --lr-warmup-samples
--lr-decay-iters --lr-decay-samples --weight-decay --clip-grad --adam-beta1 --adam-beta2
--adam-eps --init-method-std --train-iters --train-samples --eval-iters --eval-interval
--log-interval --save-interval --save --load --data-path --split --vocab-file --merge-file
--tokenizer-type --tokenizer-model --seed --attention-dropout --hidden-dropout
--transformer-impl --distributed-backend --tensorboard-dir
--wandb-project --wandb-exp-name --exit-interval --ckpt-format --num-workers --data-cache-path
--attention-backend --distributed-timeout-minutes --use-flash-attn
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
--exit-duration-in-mins --eod-mask-loss --exit-signal-handler --wandb-save-dir --wandb-entity
--log-validation-ppl-to-tensorboard --log-memory-to-tensorboard --log-world-size-to-tensorboard
--log-loss-scale-to-tensorboard --log-batch-size-to-tensorboard
--log-learning-rate-to-tensorboard --tensorboard-queue-size --no-log-learning-rate-to-tensorboard
--no-log-loss-scale-to-tensorboard --log-progress --log-straggler --full-validation
--multiple-validation-sets --valid-data-path --train-data-path --test-data-path
--skip-train --test-mode --profile --profile-step-start --profile-step-end --profile-ranks
--use-pytorch-profiler --async-save --non-persistent-save-interval --use-dist-ckpt
--dist-ckpt-format --auto-detect-ckpt-format --pretrained-checkpoint --no-initialization
--moe-grouped-gemm --moe-token-dispatcher-type --moe-aux-loss-coeff
--moe-router-load-balancing-type --moe-z-loss-coeff --moe-permute-fusion --moe-router-dtype
--moe-router-fusion --moe-input-jitter-eps --dataloader-type
--no-create-attention-mask-in-dataloader --num-dataset-builder-threads --calculate-per-token-loss
--reset-position-ids --reset-attention-mask --mmap-bin-files --no-mmap-bin-files
--per-split-data-args-path --data-args-path --object-storage-cache-path --rerun-mode
--check-for-nan-in-loss-and-grad --no-check-for-nan-in-loss-and-grad --check-for-spiky-loss
--log-timers-to-tracker --logging-level --record-memory-history --memory-snapshot-path
""".split())


def _megatron_tokens(text: str) -> list[str]:
    if "\n" not in text and not text.lstrip().startswith("-") and os.path.isfile(text.strip()):
        with open(text.strip(), encoding="utf-8") as f:  # a file of flags, as --emit writes
            text = f.read()
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as err:
        raise ValueError(f"--from-megatron: cannot split the flags: {err}") from None
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    if script is not None:  # `torchrun ... pretrain_gpt.py --flags`: the script's flags only
        tokens = tokens[script + 1:]
    if tokens and not tokens[0].startswith("--"):
        raise ValueError(f"--from-megatron: expected Megatron-LM flags (--name value ...) or a "
                         f"file of them, got {tokens[0]!r}, which is neither")
    return tokens


def read_megatron_flags(text: str) -> tuple[dict, list[str]]:
    """{flag: value} (True for a switch, a list for --recompute-modules) and the ignored flags;
    every unknown flag is named in one error; a missing value or a flag given twice is an
    error naming it."""
    tokens = _megatron_tokens(text)
    values, ignored, unknown, i = {}, [], [], 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ValueError(f"--from-megatron: {token!r} follows no flag that takes it")
        name, eq, inline = token.partition("=")
        kind = MEGATRON_FLAGS.get(name)
        if kind is None:  # skipped with its values; an unknown one said with the others
            (ignored if name in MEGATRON_IGNORED else unknown).append(name)
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
                value = positive(name, value)
        if name in values and values[name] != value:
            raise ValueError(f"{name} is given twice ({values[name]!r} and {value!r})")
        values[name] = value
    if unknown:
        raise ValueError(f"unknown Megatron-LM flag{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(dict.fromkeys(unknown))} (fxpar reads the parallel, batch, "
                         f"recompute and model flags and ignores optimizer, data and logging "
                         f"ones): remove {'them' if len(unknown) > 1 else 'it'}")
    return _one_name(values), ignored


def _one_name(values: dict) -> dict:
    """Each setting under the name read here, whichever of Megatron-LM's names gave it (the
    name given kept under WRITTEN, for the messages)."""
    out, written = dict(values), {}
    for alias, name in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            raise ValueError(f"{alias} {value} and {name} {out[name]} name one setting: give "
                             f"one")
        out[name], written[name] = value, alias
    out[WRITTEN] = written
    return out


WRITTEN = "written names"  # not a flag: {flag read here: the other name it was given as}


def _name(f: dict, flag: str) -> str:
    """The flag as the configuration wrote it."""
    return f.get(WRITTEN, {}).get(flag, flag)


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
    notes: list[str] = [f"{flag} {NUMERICS[flag]}" for flag in NUMERICS if flag in f]
    tp = f.get("--tensor-model-parallel-size", 1)
    pp = f.get("--pipeline-model-parallel-size", 1)
    cp = f.get("--context-parallel-size", 1)
    if gpus % (tp * pp * cp):
        raise ValueError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
                         f"{pp} x --context-parallel-size {cp} = {tp * pp * cp} does not divide "
                         f"the {gpus} GPUs (--gpus)")
    dp = gpus // (tp * pp * cp)
    ep = megatron_ep(f, facts.experts.count if facts.experts else None, tp, cp, dp, notes)
    if "--micro-batch-size" not in f:
        raise ValueError("--micro-batch-size is missing (Megatron-LM requires it)")
    mb = f["--micro-batch-size"]
    seq = sized("--seq-length", f.get("--seq-length"), ours_seq, "--seq")
    if "--max-position-embeddings" in f and seq is not None and \
            f["--max-position-embeddings"] < seq:
        raise ValueError(f"--max-position-embeddings {f['--max-position-embeddings']} is below "
                         f"the sequence length {seq}")
    model_check(f, facts, seq, notes)
    padding = vocab_padding_note(facts.vocab, f.get("--make-vocab-size-divisible-by",
                                                    VOCAB_DIVISOR), tp)
    notes += [padding] if padding else []
    batch = sized("--global-batch-size", f.get("--global-batch-size"), ours_batch,
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
    zero = _megatron_zero(f)
    if ours_zero1 and zero != 1:
        raise ValueError("--zero1 contradicts the Megatron-LM flags, which lack "
                         "--use-distributed-optimizer")
    sixteen = bool(f.get("--bf16") or f.get("--fp16"))
    if sixteen != (facts.dtype_bytes == 2):
        notes.append(f"{'--bf16/--fp16' if sixteen else 'without --bf16 or --fp16 (fp32)'}: "
                     f"priced in the model's own {8 * facts.dtype_bytes}-bit precision")
    config = Configuration(dp, tp, pp, cp, mb, "interleaved-1f1b" if v > 1 else "1f1b", v,
                           stages, ends="vocab-tp" if tp > 1 else "auto",
                           zero=zero if dp * cp > 1 else 0, ep=ep)
    return Imported("Megatron-LM", config, seq, batch, ours_zero1, notes, ignored, recompute)


# --data-parallel-sharding-strategy of Megatron-FSDP -> fxpar's ZeRO level
MEGATRON_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _megatron_zero(f: dict) -> int:
    """The ZeRO level the flags run: the distributed optimizer shards optimizer states (1);
    Megatron-FSDP shards what its strategy names (default optim_grads_params)."""
    strategy = f.get("--data-parallel-sharding-strategy")
    if strategy is not None and strategy not in MEGATRON_SHARDING:
        raise ValueError(f"--data-parallel-sharding-strategy {strategy!r}: Megatron-LM knows "
                         f"{', '.join(MEGATRON_SHARDING)}")
    if f.get("--use-megatron-fsdp"):
        return MEGATRON_SHARDING[strategy or "optim_grads_params"]
    if strategy is not None:
        raise ValueError("--data-parallel-sharding-strategy applies with --use-megatron-fsdp")
    return 1 if f.get("--use-distributed-optimizer") else 0


def _megatron_stages(f: dict, layers: int, pp: int) -> list[int]:
    vflags = [k for k in ("--num-layers-per-virtual-pipeline-stage",
                          "--num-virtual-stages-per-pipeline-rank",
                          "--pipeline-model-parallel-layout") if k in f]
    if len(vflags) > 1:
        raise ValueError(f"{_name(f, vflags[0])} and {_name(f, vflags[1])} are exclusive "
                         f"(Megatron-LM accepts one)")
    embed = bool(f.get("--account-for-embedding-in-pipeline-split"))
    loss = bool(f.get("--account-for-loss-in-pipeline-split"))
    first, last = (f.get("--decoder-first-pipeline-num-layers"),
                   f.get("--decoder-last-pipeline-num-layers"))
    ends_given = " and ".join(_name(f, k) for k in ("--decoder-first-pipeline-num-layers",
                                                    "--decoder-last-pipeline-num-layers") if k in f)
    if "--pipeline-model-parallel-layout" in f:
        for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split"):
            if flag in f:
                raise ValueError(f"{_name(f, flag)} contradicts "
                                 f"--pipeline-model-parallel-layout, which places every layer")
        return parse_layout(f["--pipeline-model-parallel-layout"], layers, pp)
    if first is not None or last is not None:
        if vflags or embed or loss:
            other = _name(f, vflags[0]) if vflags else (
                "--account-for-embedding-in-pipeline-split" if embed
                else "--account-for-loss-in-pipeline-split")
            raise ValueError(f"{ends_given} with {other}: give the stages as "
                             f"--pipeline-model-parallel-layout")
        ends = (first or 0) + (last or 0)
        middle = pp - (first is not None) - (last is not None)
        rest = layers - ends
        if rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise ValueError(f"{ends_given} {first}/{last} leave {rest} layers for {middle} "
                             f"middle stages of --pipeline-model-parallel-size {pp}")
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
