"""The `fxpar` command line."""
from __future__ import annotations

import argparse
import json
import sys
import time

from planner.plan import GiB

EXAMPLES = {
    "plan": "examples:\n  fxpar plan --model gpt3-175b --gpus 1024 --cluster a100-80g-dgx\n"
            "  fxpar plan --model llama2-7b --gpus 64 --json\n"
            "  fxpar plan --model gpt2-xl --gpus 8 --fix tp=2,pp=4 --memory-limit 40",
    "run": "examples:\n  fxpar run --model gpt-tiny --gpus 8 --steps 3\n"
           "  fxpar run --model llama-tiny --gpus 4 --fix tp=2,pp=2",
}


def _fix(text: str) -> dict:
    """'tp=8,pp=8,dp=16,mb=1,strategy=tp' -> {'tp': 8, ..., 'strategy': 'tp'}"""
    known = {"tp", "pp", "dp", "mb"}
    result: dict = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "strategy" and value:
            result[key] = value
        elif key in known and value.isdigit() and int(value) >= 1:
            result[key] = int(value)
        else:
            raise argparse.ArgumentTypeError(
                f"bad --fix item {item!r}: use key=positive-int with keys {sorted(known)}, "
                f"or strategy=none|tp|...")
    return result


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny", help="preset name (see --list-models)")
    p.add_argument("--gpus", type=_positive_int, required=True, help="number of devices")
    p.add_argument("--cluster", default=None,
                   help="cluster preset (cpu-gloo, a100-80g-dgx, h100-sxm-dgx, h200-sxm-dgx) "
                        "or a profile JSON written by `fxpar calibrate`")
    p.add_argument("--global-batch", type=_positive_int, default=None)
    p.add_argument("--seq", type=_positive_int, default=None)
    p.add_argument("--memory-limit", type=float, default=None, help="GiB per device (what-if)")
    p.add_argument("--fix", type=_fix, default={}, help="fix part of the plan, e.g. tp=8,pp=8,mb=1")
    for size in ("layers", "hidden", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{size}", type=_positive_int, default=None,
                       help=f"override the preset's {size.replace('-', ' ')}")


def _config(args):
    from planner.models import get_config
    sizes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "vocab")}
    sizes["seq"] = args.seq
    return get_config(args.model, **sizes)


def _plans(args, top_k: int = 5):
    from planner.api import plan
    limit = args.memory_limit * GiB if args.memory_limit is not None else None
    return plan(_config(args), args.gpus, cluster=args.cluster, global_batch=args.global_batch,
                memory_limit=limit, fix=args.fix, top_k=top_k)


def cmd_plan(args) -> int:
    start = time.perf_counter()
    best = _plans(args)[0]
    if args.json:
        data = best.to_json()
        print(json.dumps(data, indent=2))
    else:
        print(best)
        print(f"planned in {time.perf_counter() - start:.2f} s")
    return 0


def cmd_run(args) -> int:
    from planner.train import compare_with_reference
    best = _plans(args)[0]
    print(best)
    print()
    compare_with_reference(_config(args), best, steps=args.steps)
    return 0


def cmd_calibrate(args) -> int:
    from cost_model.calibrate import main as calibrate_main
    return calibrate_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpar", description="Auto-parallel planner for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="choose the fastest plan that fits", epilog=EXAMPLES["plan"],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
    r = sub.add_parser("run", help="plan, then train on local gloo CPU ranks beside one process",
                       epilog=EXAMPLES["run"], formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(r)
    r.add_argument("--steps", type=_positive_int, default=3)
    r.set_defaults(func=cmd_run, cluster="cpu-gloo")
    c = sub.add_parser("calibrate", help="measure this machine and write a cluster profile",
                       add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError, KeyError) as err:
        print(f"fxpar: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
