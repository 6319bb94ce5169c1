"""Set-up memory: a Llama-style model of over a billion parameters trained on 8 gloo ranks, each
rank materialising only its own shard from the meta device (planner.weights.materialize).

    python examples/bench_setup_memory.py                 # 1.17 B parameters, tp=2 x pp=4, 3 steps
    python examples/bench_setup_memory.py --layers 2 --hidden 256 --vocab 1024   # a quick look

Prints, per rank, the baseline of an empty rank (torch imported, process group joined), the
peak resident memory after set-up and after the steps, and the plan's predicted memory per device
for the rank's stage — with plain SGD (no optimizer state), so the prediction compared is the
plan's weights + gradients + activations; the plan's Adam figure is printed beside it. Also what
whole fp32 copies of the model on every rank would take.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from planner.models.presets import ModelConfig  # noqa: E402
from planner.training.pretrained import Source, plan_for  # noqa: E402
from planner.bench.setup_memory import GiB, memory_worker, table, vocab_parallel  # noqa: E402
from runtime.launch.ranks import run_local  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    config = ModelConfig("llama", args.layers, args.hidden, args.heads, args.vocab, args.seq,
                         kv_heads=args.kv_heads, ffn=args.ffn, global_batch=args.batch,
                         name="llama-bench")
    source = Source(config=config, global_batch=args.batch)
    n = sum(p.numel() for p in source.meta_model().parameters())
    plan = vocab_parallel(plan_for(source, 8, dict(dp=1, tp=2, pp=4, mb=1, strategy="tp",
                                                   schedule="1f1b"), memory_limit=1024))
    print(f"{config.name}: {n / 1e9:.3f} B parameters ({args.layers} layers, hidden "
          f"{args.hidden}, vocab {args.vocab}); whole fp32 copies on 8 ranks would take "
          f"{8 * 4 * n / GiB:.1f} GiB")
    print(f"plan: dp={plan.dp} x tp={plan.tp} x pp={plan.pp}, {plan.schedule}, "
          f"{plan.num_microbatches} micro-batches of {plan.micro_batch} x {args.seq} tokens; "
          f"embedding and head vocabulary-parallel")
    results = run_local(memory_worker, 8, (config, plan.dumps(), args.steps, args.batch),
                        timeout_s=600)
    print(table(plan, results))
    total = sum(r["peak"] for r in results)
    losses = ", ".join(f"{x:.4f}" for x in results[0]["losses"])
    setup = max(r["setup_s"] for r in results)
    step = max(max(r["step_s"]) for r in results)
    print(f"sum of the 8 ranks' peak RSS: {total / GiB:.1f} GiB; losses: {losses}; set-up "
          f"{setup:.1f} s, slowest step {step:.1f} s")


if __name__ == "__main__":
    main()
