"""The `fxpar` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cost_model.hardware.runtimes import RUNTIMES

EXAMPLES = {
    "plan": "examples:\n  fxpar plan --model gpt3-175b --gpus 1024 --cluster a100-80g-dgx\n"
            "  fxpar plan --model llama2-7b --gpus 64 --cluster h100-sxm-dgx --json > a.json\n"
            "  fxpar plan --model llama2-7b --gpus 64 --cluster h100-sxm-dgx "
            "--fix tp=8,pp=8,dp=1,mb=1,strategy=tp --json > b.json\n"
            "  fxpar plan --diff a.json b.json\n"
            "  fxpar plan --model gpt2-xl --gpus 8 --explain --memory-limit 40",
    "simulate": "examples:\n  fxpar simulate --model gpt2-xl --gpus 32 --fix pp=4,dp=8,mb=1 "
                "--global-batch 64 --out timeline/\n"
                "  fxpar plan --model llama2-7b --gpus 64 --json > plan.json && "
                "fxpar simulate --plan plan.json\n",
    "bench": "examples:\n  fxpar bench --model gpt-tiny --gpus 4 --cluster cpu-gloo\n"
             "  fxpar bench --model gpt2-small --gpus 8 --cluster profile.json --top-k 5\n",
    "export": "examples:\n  fxpar export --checkpoint ckpt/ --out out/model.safetensors",
    "run": "examples:\n  fxpar run --model gpt-tiny --gpus 8 --steps 3\n"
           "  fxpar run --model llama2-7b --gpus 64 --cluster h100-sxm-dgx --torchrun job/\n"
           "  fxpar run --model llama-tiny --gpus 4 --fix tp=2,pp=2",
    "train": "examples:\n  fxpar data prepare /usr/lib/python3.11 --out data/stdlib\n"
             "  fxpar train run.toml --nproc-per-node 4 --training.steps 300\n"
             "  fxpar train run.toml --check\n"
             "overrides: --SECTION.KEY VALUE for any key of the config (docs/training.md)",
    "validate": "examples:\n  fxpar validate\n"
                "  fxpar validate --match deepseek --json > deepseek.json\n"
                "  fxpar validate --cluster profile.json --csv my-runs.csv\n"
                "  fxpar validate --fit\n  fxpar validate --cross-validate",
}


def _fix(text: str) -> dict:
    """--fix's value (planner.search.meshes.parse_fix); a bad item is an argparse error naming
    the key and its legal values."""
    from planner.search.meshes import parse_fix
    try:
        return parse_fix(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _imbalance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a factor >= 1 (the most loaded rank's "
                                         f"tokens over the mean, e.g. 1.2), got {text!r}")
    return value


RUNTIME_NAMES = tuple(RUNTIMES)   # the runtime profiles --runtime offers


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number (0, 1, 2, ...), got {text!r}")
    return int(text)


def _model_args(p: argparse.ArgumentParser, required: bool = True, hf: bool = True) -> None:
    """The model and cluster flags; `hf` False (run, bench: presets only) keeps the Hugging Face
    flags out of the help, and their use is refused with what to run instead (_preset_only)."""
    p.add_argument("--model", default=None,
                   help="preset (fxpar run and bench: default gpt-tiny): gpt-tiny, gpt2-small, "
                        "gpt2-xl, gpt3-175b, llama-tiny, llama2-7b, llama2-70b, mixtral-tiny, "
                        "mixtral-8x7b, deepseek-tiny, deepseek-v3; diffusion transformers dit-tiny, dit-tiny-cross, dit-xl-2")
    p.add_argument("--gpus", type=_positive_int, required=required, help="number of devices")
    p.add_argument("--cluster", default=None,
                   help="cluster preset (cpu-gloo, a100-80g-dgx, h100-sxm-dgx, h200-sxm-dgx) "
                        "or a profile JSON written by `fxpar calibrate`")
    p.add_argument("--runtime", default=None, choices=RUNTIME_NAMES,
                   help="the training framework to price for (GPU clusters): fxpar's own "
                        "(default), megatron (Megatron-Core + Transformer Engine), megatron-lm, "
                        "torchtitan, torchtitan-compile, fsdp, automodel; --emit and --from-* "
                        "default to their framework's")
    p.add_argument("--autocast", default=None, choices=("bf16", "fp16"),
                   help="price the activations as the runtime's autocast of that name saves "
                        "them (16-bit matmuls over fp32 weights; default: the weights' own "
                        "dtype, bf16 with fp32 main weights on GPUs)")
    p.add_argument("--global-batch", type=_positive_int, default=None,
                   help="sequences per training step over all GPUs (default: the preset's; "
                        f"{HF_GLOBAL_BATCH} for a Hugging Face model)")
    p.add_argument("--seq", type=_positive_int, default=None,
                   help="tokens per sequence (default: the preset's, or the Hugging Face "
                        "model's; the plan's header says which)")
    p.add_argument("--memory-limit", type=float, default=None, help="GiB per device (what-if)")
    p.add_argument("--fix", type=_fix, default={},
                   help="fix part of the plan, e.g. tp=8,pp=8,mb=1 or cp=2,schedule=1f1b")
    p.add_argument("--zero1", action="store_true",
                   help="shard optimizer states over data parallel: the same as --fix zero=1")
    p.add_argument("--moe-imbalance", type=_imbalance, default=None, metavar="FACTOR",
                   help="mixture of experts: the most loaded expert-parallel rank's tokens over "
                        "the mean (>= 1; default: the expected maximum of uniform routing)")
    shown = (lambda text: text) if hf else (lambda text: argparse.SUPPRESS)
    p.add_argument("--hf", metavar="ARCH", help=shown(
        "a Hugging Face architecture (any decoder-only model_type: gpt2, llama, gemma2, ...; "
        "encoder-decoder: t5, bart, ...) at small sizes, built from its config; needs the hf "
        "extra"))
    p.add_argument("--hf-config", metavar="FILE.json", help=shown("a Hugging Face config.json"))
    p.add_argument("--parts", metavar="LIST[,LIST]", default=None, help=shown(
        "a Hugging Face model's lists of blocks to split into stages (module names, e.g. "
        "model.language_model.layers); default: every outermost list of blocks that runs after "
        "the others"))
    whose = "the preset's (or --hf's)" if hf else "the preset's"
    for size in ("layers", "hidden", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{size}", type=_positive_int, default=None,
                       help=f"override {whose} {size.replace('-', ' ')}")


def _config(args):
    """The preset with the size overrides and --global-batch: what is planned is what trains."""
    from planner.models.presets import get_config
    if getattr(args, "parts", None):
        raise ValueError("--parts names a Hugging Face model's lists of blocks (--hf, "
                         "--hf-config); a preset has one list, split as it is")
    sizes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "vocab")}
    sizes["seq"] = args.seq
    sizes["global_batch"] = args.global_batch
    return get_config(args.model or "gpt-tiny", **sizes)


# the flags that choose and size the model and the request: what --diff and --plan leave out
MODEL_FLAGS = ("--model", "--hf", "--hf-config", "--gpus", "--cluster", "--runtime", "--autocast",
               "--global-batch", "--seq", "--memory-limit", "--fix", "--zero1", "--moe-imbalance",
               "--parts", "--layers", "--hidden", "--heads", "--kv-heads", "--vocab")


def _given(args, flags) -> list[str]:
    """Those of `flags` the command line set: argparse leaves the others None, False or {}."""
    values = {f: getattr(args, f[2:].replace("-", "_")) for f in flags}
    return [f for f, v in values.items() if v is not None and v is not False and v != {}]


def _refuse(args, flags, mode: str, advice: str) -> None:
    """A flag that `mode` would ignore is an error naming it and, in `advice` (where {flags}
    stands for the flags given), what to do instead."""
    given = ", ".join(_given(args, flags))
    if given:
        raise ValueError(f"{given} {'do' if ',' in given else 'does'} not apply to {mode}: "
                         + advice.format(flags=given))


def _hf_model(args):
    """The Hugging Face model and a global batch, on the meta device (no weights allocated)."""
    import torch

    from planner.models.hf import build_hf, build_hf_from_file, example_inputs, sequence_length
    from planner.models.hf_moe import has_experts, use_routed_experts
    models = _given(args, ("--model", "--hf", "--hf-config"))
    if len(models) > 1:
        raise ValueError(f"{' and '.join(models)} each name the model: give one of --model "
                         f"PRESET, --hf ARCH or --hf-config FILE.json")
    sizes = {name: getattr(args, flag) for flag, name in _HF_SIZES.items()
             if getattr(args, flag) is not None}
    if sizes and args.hf_config:
        flags = [f"--{f.replace('_', '-')}" for f in _HF_SIZES if getattr(args, f)]
        raise ValueError(f"{', '.join(flags)} {'does' if len(flags) == 1 else 'do'} not apply "
                         f"to --hf-config: a config.json states the model; edit its "
                         f"{', '.join(sizes)} instead")
    with torch.device("meta"):
        model = build_hf_from_file(args.hf_config) if args.hf_config else build_hf(args.hf,
                                                                                   **sizes)
    if has_experts(model):  # mixture of experts: one routed_experts op per layer, ep searched
        use_routed_experts(model)
    # trained in bf16 there (precision "bf16-main"): planned so, unless autocast over fp32 is asked
    bf16 = _on_gpus(args) and not getattr(args, "autocast", None)
    if bf16:
        model = model.to(torch.bfloat16)
    if getattr(args, "parts", None):
        model.fxpar_parts = tuple(filter(None, (p.strip() for p in args.parts.split(","))))
    seq = args.seq or sequence_length(model)
    inputs = example_inputs(model, args.global_batch or HF_GLOBAL_BATCH, seq)
    return model, tuple(x.to(torch.bfloat16) if x.is_floating_point() and bf16 else x
                        for x in inputs)


def _on_gpus(args) -> bool:
    from cost_model.hardware.cluster import get_cluster
    from planner.api import default_cluster
    return get_cluster(args.cluster or default_cluster()).device == "cuda"


HF_GLOBAL_BATCH = 16   # a Hugging Face model's global batch without --global-batch
# size flags -> the standard names of a transformers config
_HF_SIZES = {"layers": "num_hidden_layers", "hidden": "hidden_size",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "vocab": "vocab_size"}


def hf_sizes_from(args, seq: int) -> str:
    """Where a Hugging Face model's sizes came from, as the plan states them."""
    from_seq = ("--seq" if args.seq else
                "the config's maximum positions (--seq to plan another)")
    batch = "--global-batch" if args.global_batch else "default (--global-batch to change)"
    return f"seq {seq}: {from_seq}   global batch: {batch}"


def _plans(args, top_k: int = 1):
    from planner.api import plan
    model, inputs = _hf_model(args) if args.hf or args.hf_config else (_config(args), None)
    sizes_from = hf_sizes_from(args, inputs[0].shape[1]) if inputs is not None else None
    return plan(model, args.gpus, inputs, cluster=args.cluster, global_batch=args.global_batch,
                memory_limit=args.memory_limit, fix=args.fix, top_k=top_k, zero1=args.zero1,
                moe_imbalance=args.moe_imbalance, sizes_from=sizes_from, runtime=args.runtime,
                autocast=args.autocast)


def _load_plan(path: str):
    from planner.search.plan import Plan
    not_a_plan = f"{path} is not a plan written by `fxpar plan --json`"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"cannot read plan file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{not_a_plan}: not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{not_a_plan}: not JSON ({err.msg} at line {err.lineno} column "
                         f"{err.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{not_a_plan}: expected a JSON object, got {type(data).__name__}")
    try:
        return Plan.from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"{not_a_plan}: {err}") from None


def cmd_plan(args) -> int:
    from planner.report.explain import diff, explain
    if args.diff:
        _refuse(args, MODEL_FLAGS + PLAN_OUTPUTS, "--diff",
                "it compares the two saved plans as they are; drop {flags}")
        a, b = (_load_plan(p) for p in args.diff)
        print(diff(a, b, tuple(args.diff)))
        return 0
    if args.gpus is None or not (args.model or args.hf or args.hf_config):
        raise ValueError("fxpar plan needs --gpus and a model: --model PRESET, --hf ARCH or "
                         "--hf-config FILE.json (or --diff A.json B.json)")
    _check_plan_outputs(args)
    if args.emit or args.from_megatron is not None or args.from_torchtitan:
        if args.autocast:
            raise ValueError("--autocast prices fxpar's runtime under torch.autocast; --emit and "
                             "--from-* price the other framework's own precision (bf16 weights "
                             "and fp32 main weights): leave --autocast out")
        from planner.interop.price_imported import cmd_portable  # --emit, --from-megatron, --from-torchtitan
        return cmd_portable(args, _config, _hf_model)
    start = time.perf_counter()
    plans = _plans(args, top_k=args.top_k if args.explain else 1)
    best = plans[0]
    # --json: the same bytes for the same request, but for the last key, timing
    print(best.dumps() if args.json else best)
    if args.png:  # beside --json, its line goes to stderr: stdout stays JSON
        from planner.report.pictures import plot_plan
        print(f"plan picture written to {plot_plan(best, args.png)}",
              file=sys.stderr if args.json else sys.stdout)
    if args.json:
        return 0
    if args.explain:
        print()
        print(explain(plans))
    print(f"planned in {time.perf_counter() - start:.2f} s")
    if args.check or args.check_every_rank:
        _check(args, best)
    return 0


PLAN_OUTPUTS = ("--json", "--explain", "--top-k", "--png", "--check", "--check-every-rank",
                "--emit", "--emit-csv", "--from-megatron", "--from-torchtitan")
TOP_K = 5  # fxpar plan --explain's alternatives without --top-k


def _check_plan_outputs(args) -> None:
    """Refuse fxpar plan's flags that the others given leave nothing to do (--json and --png
    with --emit and --from-*: planner.interop.price_imported)."""
    if args.emit_csv and args.emit != "torchtitan":
        raise ValueError("--emit-csv names the schedule CSV that --emit torchtitan writes"
                         + ("; --emit megatron writes none: drop --emit-csv" if args.emit else
                            ": add --emit torchtitan or drop --emit-csv"))
    if args.top_k and not args.explain:
        raise ValueError("--top-k sets how many alternatives --explain prints: add --explain or "
                         "drop --top-k")
    args.top_k = args.top_k or TOP_K
    if args.json:
        _refuse(args, ("--explain", "--check", "--check-every-rank"), "--json",
                "it prints the plan alone, as JSON; run {flags} without --json")
    for mode in _given(args, ("--emit", "--from-megatron", "--from-torchtitan"))[:1]:
        _refuse(args, ("--check", "--check-every-rank"), mode,
                "it dry-runs fxpar's own plan; run {flags} without " + mode)
        if args.emit:
            _refuse(args, ("--explain",), mode, "--emit prints one configuration; --explain "
                    "goes with fxpar's plan or --from-*")


def _check(args, best) -> None:
    """--check: the plan's rank programs dry-run on fake tensors (planner.bench.memory_check)."""
    import dataclasses

    from planner.bench.memory_check import check, check_table
    start = time.perf_counter()
    if args.hf or args.hf_config:
        spec = _hf_model(args)
    else:
        spec = dataclasses.replace(_config(args), global_batch=best.global_batch)
    dry = check(best, spec, every_rank=True if args.check_every_rank else None)
    print()
    print(check_table(best, dry))
    print(f"dry-ran {len(dry)} rank{'s' if len(dry) > 1 else ''} in "
          f"{time.perf_counter() - start:.1f} s")


def cmd_simulate(args) -> int:
    from planner.report.pictures import predicted_timeline, write_timeline
    from planner.search.plan import plural
    if args.plan:
        _refuse(args, MODEL_FLAGS, "--plan", "it simulates the saved plan as it is; drop {flags}, "
                "or drop --plan to plan anew")
        chosen = _load_plan(args.plan)
    elif args.gpus and (args.model or args.hf or args.hf_config):
        chosen = _plans(args, top_k=1)[0]
    else:
        raise ValueError("fxpar simulate needs --plan PLAN.json, or --model and --gpus")
    timeline = predicted_timeline(chosen)
    print(f"{chosen.model} on {chosen.gpus} GPUs: {chosen.schedule}, "
          f"{plural(chosen.pp, 'stage')} x {plural(chosen.num_microbatches, 'micro-batch')}")
    print(f"simulated iteration {timeline.makespan:.4g} s (pipeline only, without data-parallel "
          f"sync), bubble fraction {timeline.bubble_fraction():.3f}, peak in-flight micro-batches "
          f"per rank {list(timeline.peak_inflight)}")
    for path in write_timeline(chosen, args.out):
        print(f"wrote {path}")
    return 0


def _preset_only(args, command: str) -> None:
    if args.hf or args.hf_config:
        weights = ", a checkpoint directory with --weights DIR" if command == "run" else ""
        raise ValueError(f"fxpar {command} trains presets (--model with size overrides){weights}; "
                         f"plan a Hugging Face model with fxpar plan, train it with "
                         f"autoparallelize")


def cmd_run(args) -> int:
    from planner.training.local import compare_with_reference
    if args.torchrun and (args.checkpoint or args.save_every or args.resume):
        raise ValueError("--checkpoint, --save-every and --resume train on local gloo ranks; "
                         "under torchrun call pm.save(DIR) / pm.load(DIR) in the training script")
    if args.checkpoint and not (args.save_every or args.resume):
        raise ValueError("--checkpoint DIR alone neither saves nor resumes: add --save-every N "
                         "(save into DIR) and/or --resume (continue from DIR's latest)")
    if args.weights:  # a Hugging Face checkpoint directory, read per shard
        _refuse(args, ("--model", "--runtime", "--autocast", "--zero1", "--moe-imbalance",
                       "--parts"), "--weights", "the model is DIR/config.json's, trained with "
                "fxpar's runtime and planned from --gpus, --cluster, --fix (zero=1 for ZeRO-1), "
                "--memory-limit and --global-batch; drop {flags}")
        from planner.training.pretrained import cmd_run_weights
        return cmd_run_weights(args)
    _preset_only(args, "run")
    _own_runtime(args, "run")
    best = _plans(args)[0]
    print(best)
    print()
    if args.torchrun:
        from planner.bench.plans import torchrun_command
        print(torchrun_command(best, _config(args), args.steps, args.torchrun))
        return 0
    if args.checkpoint or args.save_every or args.resume:  # planner.training.resume
        from planner.training.resume import compare_resumed
        compare_resumed(_config(args), best, args.steps, args.checkpoint, args.save_every,
                        args.resume)
        return 0
    compare_with_reference(_config(args), best, steps=args.steps)
    return 0


def _own_runtime(args, command: str) -> None:
    """`fxpar run` and `fxpar bench` run fxpar's own runtime: a plan priced for another one
    would be measured against a prediction it was not made for."""
    if args.runtime not in (None, "fxpar"):
        raise ValueError(f"fxpar {command} trains with fxpar's own runtime; --runtime "
                         f"{args.runtime} prices plans for another framework: use it with "
                         f"fxpar plan (or --emit)")
    if args.autocast:
        raise ValueError(f"fxpar {command} trains in the weights' own dtype (and compares with "
                         f"them); --autocast is for fxpar plan, and fxpar train's precision "
                         f"\"bf16\" / \"fp16\" trains under it")


def cmd_bench(args) -> int:
    from planner.bench.plans import bench, plot, report
    _preset_only(args, "bench")
    _own_runtime(args, "bench")
    if args.memory:
        _refuse(args, ("--warmup", "--rounds", "--png", "--explain"), "--memory",
                "it measures each plan's peak memory over --steps steps, not its time; drop "
                "{flags}")
    plans = _plans(args, top_k=args.top_k)
    if args.memory:
        return _bench_memory(args, plans)
    warmup, rounds = 2 if args.warmup is None else args.warmup, args.rounds or 1
    png = args.png or "fxpar-bench.png"
    print(f"benchmarking the top {len(plans)} plans for {plans[0].model} on {args.gpus} "
          f"{'GPUs' if plans[0].cluster != 'cpu-gloo' else 'gloo CPU ranks'}, {args.steps} steps "
          f"each after {warmup} warm-up steps"
          + (f", the plans in turn {rounds} times" if rounds > 1 else ""))
    results = bench(plans, _config(args), args.steps, warmup, rounds)
    print(report(plans, results))
    print(f"plot written to {plot(plans, results, png)}")
    if args.explain:
        from cost_model.hardware.cluster import get_cluster
        from planner.bench.explain import explain_table, write_traces
        cluster = get_cluster(args.cluster)
        stem = os.path.splitext(png)[0]
        for i, (p, m) in enumerate(zip(plans, results)):
            print(f"\nplan {i + 1}: dp={p.dp} tp={p.tp} pp={p.pp}{f' cp={p.cp}' if p.cp > 1 else ''}"
                  f" {p.schedule} x{p.num_microbatches} micro-batches")
            print(explain_table(p, cluster, m.ranks))
            print(f"traces: {write_traces(p, cluster, m.ranks, f'{stem}-plan{i + 1}-trace.json')}")
    return 0


def _bench_memory(args, plans) -> int:
    """fxpar bench --memory (planner.bench.memory.bench_memory)."""
    from planner.bench.memory import bench_memory
    if plans[0].cluster != "cpu-gloo":
        raise ValueError("fxpar bench --memory measures on local gloo CPU ranks: plan with "
                         "--cluster cpu-gloo (on GPUs, fxpar train reports each rank's CUDA "
                         "peak)")
    for text in bench_memory(plans, _config(args), max(args.steps, 2)):
        print(text)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too (with where to read more), exit status 2."""

    def error(self, message: str):
        if "--from-megatron: expected one argument" in message:  # its value starts with --
            message += ("; Megatron-LM's flags start with --: attach them, "
                        "--from-megatron='--sequence-parallel ...'")
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(message: str, limit: int = 600) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxpar", description="Auto-parallel planner for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="choose the fastest plan that fits", epilog=EXAMPLES["plan"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p, required=False)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--explain", action="store_true",
                   help="also print the top alternatives, the binding constraint and what the "
                        "next best gives up")
    p.add_argument("--top-k", type=_positive_int, default=None,
                   help=f"alternatives for --explain (default {TOP_K})")
    p.add_argument("--diff", nargs=2, metavar=("A.json", "B.json"),
                   help="compare two plans written by --json")
    p.add_argument("--png", metavar="FILE", help="also draw the plan (stages x layers, memory)")
    p.add_argument("--check", action="store_true", help="dry-run the plan's rank programs for "
                   "two steps on fake tensors and print each rank's peak memory beside the "
                   "prediction (one rank per pipeline rank over 16 GPUs)")
    p.add_argument("--check-every-rank", action="store_true", help="--check on every rank")
    p.add_argument("--emit", choices=("torchtitan", "megatron"),
                   help="print the plan as a torchtitan TOML fragment or Megatron-LM flags")
    p.add_argument("--emit-csv", metavar="FILE.csv", help="where --emit torchtitan writes a "
                   "schedule torchtitan has no class for (default fxpar-SCHEDULE-ppP-mM.csv)")
    p.add_argument("--from-megatron", metavar="FLAGS", help="price Megatron-LM flags (or a "
                   "file of them, as --emit megatron writes) beside fxpar's plan")
    p.add_argument("--from-torchtitan", metavar="FILE.toml", help="price a torchtitan TOML "
                   "beside fxpar's plan")
    p.set_defaults(func=cmd_plan)
    sim = sub.add_parser("simulate", help="predicted pipeline timeline of a plan (PNG + trace)",
                         epilog=EXAMPLES["simulate"],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(sim, required=False)
    sim.add_argument("--plan", metavar="PLAN.json", help="a plan written by `fxpar plan --json`")
    sim.add_argument("--out", default="fxpar-timeline", help="output folder")
    sim.set_defaults(func=cmd_simulate)
    r = sub.add_parser("run", help="plan, then train on local gloo CPU ranks beside one process",
                       epilog=EXAMPLES["run"], formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(r, hf=False)
    r.add_argument("--steps", type=_positive_int, default=3)
    r.add_argument("--torchrun", metavar="FOLDER",
                   help="for a cluster: write the plan to FOLDER and print the torchrun command "
                        "that trains it, instead of training on local gloo ranks")
    r.add_argument("--weights", metavar="DIR", help="a Hugging Face checkpoint directory "
                   "(config.json, model.safetensors or its index): plan its model, each rank "
                   "reads only its slices, compared with transformers' from_pretrained")
    r.add_argument("--checkpoint", metavar="DIR", help="folder of step-N checkpoints "
                   "(torch.distributed.checkpoint) to save into and resume from")
    r.add_argument("--save-every", type=_positive_int, default=0, metavar="N",
                   help="save a checkpoint into --checkpoint DIR every N steps")
    r.add_argument("--resume", action="store_true", help="continue from the latest complete "
                   "checkpoint in --checkpoint DIR, under this run's plan (any mesh)")
    r.set_defaults(func=cmd_run, cluster="cpu-gloo")
    b = sub.add_parser("bench", help="run the top plans on the devices here, predicted vs "
                       "measured", epilog=EXAMPLES["bench"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(b, hf=False)
    b.add_argument("--top-k", type=_positive_int, default=3)
    b.add_argument("--steps", type=_positive_int, default=10)
    b.add_argument("--warmup", type=_count, default=None, help="warm-up steps (default 2)")
    b.add_argument("--rounds", type=_positive_int, default=None, help="run the plans in turn "
                   "this many times and report each one's median (default 1): on a shared host "
                   "whose speed drifts, every plan then sees the same spells")
    b.add_argument("--png", default=None, help="where to write the plot (default "
                   "fxpar-bench.png)")
    b.add_argument("--memory", action="store_true", help="instead of timing: each plan's "
                   "peak live tensor memory per rank, measured (parameters, gradients, "
                   "optimizer states, activations, other) beside the prediction")
    b.add_argument("--explain", action="store_true", help="per plan, the step's parts "
                   "(compute per stage, p2p waits, data-parallel sync, optimizer, overhead, "
                   "idle) predicted beside measured on each rank, and Chrome traces of both "
                   "next to the plot")
    b.set_defaults(func=cmd_bench)
    e = sub.add_parser("export", help="a checkpoint saved under any plan as one safetensors "
                       "file (Hugging Face names for Hugging Face models)",
                       epilog=EXAMPLES["export"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint folder, or "
                   "a folder of step-N checkpoints (the latest complete one is read)")
    e.add_argument("--out", required=True, metavar="FILE.safetensors")
    e.add_argument("--main-weights", action="store_true", help="write the fp32 main weights a "
                   "bf16-main run keeps in its optimizer state, not the bf16 weights it trains")
    e.set_defaults(func=_cmd_export)
    from planner.bench.published_report import validate_parser
    validate_parser(sub, EXAMPLES["validate"])
    from planner.training.commands import train_parsers
    train_parsers(sub, EXAMPLES["train"])
    sub.add_parser("calibrate", help="measure this machine and write a cluster profile "
                   "(fxpar calibrate --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # its own parser (it also runs as python -m cost_model.calibration.calibrate)
        from cost_model.calibration.calibrate import main as calibrate_main
        from planner.bench.runtime_probes import RuntimeProbe
        return _guarded(lambda args: calibrate_main(args, runtime=RuntimeProbe()), argv[1:])
    args = build_parser().parse_args(argv)
    return _guarded(args.func, args)


def _cmd_export(args) -> int:
    from planner.weights.export import cmd_export
    return cmd_export(args)


def _summary(err: Exception):
    """A failed distributed run (runtime.launch.ranks.RankFailure) is told by its first line, which names
    the rank that failed, where and why; the other ranks and the tracebacks go to a file."""
    if not hasattr(err, "write_report"):
        return err
    return f"{err.summary} (all ranks and tracebacks: {err.write_report()})"


def _guarded(func, *args) -> int:
    """Errors the user can fix are one line on stderr, exit status 2, no traceback."""
    try:
        return func(*args) or 0
    except (ValueError, RuntimeError, OSError, KeyError) as err:
        print(f"fxpar: error: {_one_line(_summary(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM; runtime.launch.ranks has ended the ranks
        print("fxpar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
