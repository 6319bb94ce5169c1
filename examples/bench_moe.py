"""Mixtures of experts planned beside hand-tuned configurations, priced by the same cost model.

For DeepSeek-V3 on 1024 H100s (Megatron-Core's published TP2 x PP8 x VP4 x EP64, micro-batch 1,
distributed optimizer) and Mixtral 8x7B on 64 (TP1 x PP4 x EP8), prints the planner's plan and
its planning time, the hand-tuned configuration priced with --fix, and the ratio of their
predicted iteration times (the planner is never slower: the hand-tuned mesh is one it searches).

    python examples/bench_moe.py [--cluster h100-sxm-dgx] [--moe-imbalance 1.2]
"""
from __future__ import annotations

import argparse
import time

from planner.api import plan

CASES = [
    ("deepseek-v3", 1024, dict(tp=2, pp=8, v=4, schedule="interleaved-1f1b", ep=64, mb=1, zero=1,
                               cp=1), "TP2 x PP8 x VP4 x EP64"),
    ("mixtral-8x7b", 64, dict(tp=1, pp=4, ep=8, mb=1, cp=1), "TP1 x PP4 x EP8"),
]


def _mesh(p) -> str:
    v = f" x VP{p.virtual_stages}" if p.virtual_stages > 1 else ""
    return (f"TP{p.tp} x PP{p.pp}{v} x EP{p.ep} (dp={p.dp}{f', cp={p.cp}' if p.cp > 1 else ''}, "
            f"{p.schedule}, mb={p.micro_batch})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h100-sxm-dgx")
    parser.add_argument("--moe-imbalance", type=float, default=None)
    args = parser.parse_args()
    plan("mixtral-tiny", 2, cluster="cpu-gloo")  # first-use torch initialisation, not counted
    for model, gpus, fix, name in CASES:
        start = time.perf_counter()
        best = plan(model, gpus, cluster=args.cluster, moe_imbalance=args.moe_imbalance)[0]
        seconds = time.perf_counter() - start
        hand = plan(model, gpus, cluster=args.cluster, fix=fix,
                    moe_imbalance=args.moe_imbalance)[0]
        a, b = best.predicted, hand.predicted
        print(f"{model} on {gpus} GPUs ({args.cluster}), planned in {seconds:.1f} s")
        print(f"  planner     {_mesh(best):52s} {a.iteration_s:8.2f} s/iteration  "
              f"{a.peak_memory_bytes / 2**30:6.1f} GiB  {a.tflops_per_gpu:6.1f} TFLOP/s/GPU")
        print(f"  hand-tuned  {_mesh(hand):52s} {b.iteration_s:8.2f} s/iteration  "
              f"{b.peak_memory_bytes / 2**30:6.1f} GiB  {b.tflops_per_gpu:6.1f} TFLOP/s/GPU")
        print(f"  hand-tuned ({name}) / planner: {b.iteration_s / a.iteration_s:.2f}x")


if __name__ == "__main__":
    main()
