"""Predicted vs measured times on this machine: transformer blocks and collectives.

    python -m cost_model.calibration.calibrate --out /tmp/cpu.json
    python examples/bench_costs.py --cluster /tmp/cpu.json

Layers: forward + backward of one GPT-style and one Llama-style block at a few sizes, predicted by
`cost_model.layers.layer_cost.price` from the block's captured graph and measured on this CPU in fp32
with one torch thread (what a calibrated CPU "device" is). Blocks are timed by calibration's own
timer (`cost_model.calibration.bench_compute.interleaved_medians`: one warm-up each, the median of interleaved
rounds) with the clock it uses for compute, this thread's CPU time, which other processes sharing
the cores do not inflate; --clock wall includes the time they hold the core. Collectives: each kind
at a few sizes and group sizes calibration also measures, predicted and measured by
examples/bench_collectives.py through calibration's harness. Prints item, predicted ms, measured
ms, their ratio, and the median |predicted / measured - 1| of each group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

# Run from a source checkout without installing the package; bench_collectives sits beside us.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from bench_collectives import run as collective_rows  # noqa: E402
from cost_model.calibration.bench_comm import ROUNDS  # noqa: E402
from cost_model.calibration.bench_compute import CLOCKS, COMPUTE_ROUNDS, interleaved_medians  # noqa: E402
from cost_model.hardware.cluster import get_cluster  # noqa: E402
from cost_model.hardware.comm import KINDS  # noqa: E402
from cost_model.layers.layer_cost import price, profile_layer  # noqa: E402
from cost_model.layers.strategy import Strategy  # noqa: E402
from passes.capture.trace import capture  # noqa: E402
from planner.models.presets import GPTBlock, LlamaBlock, ModelConfig, build_model  # noqa: E402

KiB, MiB = 2**10, 2**20
# (arch, hidden, heads, seq, micro-batch): each runs forward + backward in well under a second.
LAYERS = (("gpt", 256, 4, 128, 2), ("gpt", 512, 8, 256, 1), ("gpt", 768, 12, 256, 2),
          ("llama", 256, 4, 128, 2), ("llama", 512, 8, 256, 1), ("llama", 768, 12, 256, 2))
COLLECTIVE_SIZES = (16 * KiB, 256 * KiB, 2 * MiB)


def layer_config(arch: str, hidden: int, heads: int, seq: int) -> ModelConfig:
    kv = heads // 2 if arch == "llama" else None  # grouped-query attention for the Llama block
    return ModelConfig(arch, 1, hidden, heads, 1000, seq, kv_heads=kv)


def predict_block(cfg: ModelConfig, batch: int, cluster) -> float:
    """Seconds for forward + backward of one block, from its graph captured on meta in fp32."""
    model = build_model(cfg, device="meta", dtype=torch.float32)
    tokens = torch.zeros(1, cfg.seq, dtype=torch.long, device="meta")
    captured = capture(model, (tokens, tokens))
    cost = price(profile_layer(captured, captured.blocks[0]), Strategy(), batch, cluster)
    return cost.fwd_s + cost.bwd_s


def block_step(cfg: ModelConfig, batch: int):
    """Forward + backward of a real block (fresh gradients each time, as the first micro-batch of
    a step writes them). With one torch thread the whole step, autograd's backward included, runs
    on this thread, so its CPU time is the step's compute time."""
    torch.manual_seed(0)
    block = (GPTBlock if cfg.arch == "gpt" else LlamaBlock)(cfg)
    x = torch.randn(batch, cfg.seq, cfg.hidden, requires_grad=True)
    grad = torch.randn_like(x)

    def step() -> None:
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x).backward(grad)

    return step


def layer_rows(cluster_name: str, reps: int, clock: str = "wall") -> list[dict]:
    cluster = get_cluster(cluster_name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a calibrated CPU device is one single-threaded rank
    try:
        configs = [(layer_config(arch, hidden, heads, seq), batch)
                   for arch, hidden, heads, seq, batch in LAYERS]
        # Interleaved rounds, as calibration times its compute (see interleaved_medians).
        measured = interleaved_medians([block_step(cfg, batch) for cfg, batch in configs], "cpu",
                                       reps, clock)
    finally:
        torch.set_num_threads(threads)
    rows = []
    for (cfg, batch), meas in zip(configs, measured):
        pred = predict_block(cfg, batch, cluster)
        rows.append(dict(item=f"{cfg.arch} block h={cfg.hidden} s={cfg.seq} b={batch}",
                         predicted_ms=pred * 1e3, measured_ms=meas * 1e3, ratio=pred / meas))
    return rows


def median_error(rows: list[dict]) -> float:
    return statistics.median(abs(r["ratio"] - 1) for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="cpu-gloo", help="preset name or profile JSON path")
    parser.add_argument("--reps", type=int, default=COMPUTE_ROUNDS,
                        help="timed rounds of the blocks (median), as in calibration's compute")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="timed rounds per collective (the fastest counts, as in calibration)")
    parser.add_argument("--no-collectives", action="store_true", help="time the layers only")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="time blocks by the wall clock or by this thread's CPU time")
    args = parser.parse_args(argv)
    layers = layer_rows(args.cluster, args.reps, args.clock)
    collectives = [] if args.no_collectives else [
        dict(item=f"{r['kind']} {r['size']} n={r['n']}", predicted_ms=r["predicted_ms"],
             measured_ms=r["measured_ms"], ratio=r["ratio"])
        for r in collective_rows(args.cluster, COLLECTIVE_SIZES, args.world_sizes, KINDS,
                                 args.rounds)]
    print(tabulate(layers + collectives, headers="keys", floatfmt=".3f"))
    print(f"\nmedian |pred/meas - 1|: layers {median_error(layers):.1%} ({len(layers)})", end="")
    if collectives:
        print(f", collectives {median_error(collectives):.1%} ({len(collectives)})", end="")
    print(f"  (cluster: {args.cluster}, blocks timed by the {args.clock} clock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
