"""GPU check: on one CUDA GPU, calibrate, then predict and measure transformer blocks and a small
pipeline's stages, and print predicted/measured ratios. Runs in a few minutes.

    python examples/gpu_check.py [--out gpu-profile.json]

The pipeline's stages run one after another on the one device (no peer to overlap with), so the
check is of the per-stage times the planner schedules with: measured m x (sum of stage times) vs
predicted.
"""
import argparse
import statistics
import sys
import time

import torch
from tabulate import tabulate

from cost_model.calibration.calibrate import calibrate
from cost_model.layers.layer_cost import price, profile_layer
from cost_model.layers.strategy import Strategy
from passes.capture.trace import capture
from planner.api import plan
from planner.models.presets import GPTBlock, LlamaBlock, ModelConfig, build_model, example_batch

BLOCKS = (("gpt", 2048, 16, 2048, 1), ("gpt", 4096, 32, 2048, 1), ("llama", 4096, 32, 2048, 1),
          ("llama", 4096, 32, 4096, 2))
DTYPE = torch.bfloat16


def cuda_time(step, reps: int = 10) -> float:
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def block_row(cluster, arch, hidden, heads, seq, batch) -> list:
    cfg = ModelConfig(arch, 1, hidden, heads, 32000, seq, kv_heads=heads // 4 if arch == "llama"
                      else None)
    meta = build_model(cfg, device="meta", dtype=DTYPE)
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    captured = capture(meta, (tokens, tokens))
    cost = price(profile_layer(captured, captured.blocks[0]), Strategy(), batch, cluster)
    block = (GPTBlock if arch == "gpt" else LlamaBlock)(cfg).to("cuda", DTYPE)
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    grad = torch.randn_like(x)
    measured = cuda_time(lambda: block(x).backward(grad))
    predicted = cost.fwd_s + cost.bwd_s
    return [f"{arch} block h={hidden} s={seq} b={batch}", predicted * 1e3, measured * 1e3,
            predicted / measured]


def pipeline_row(cluster) -> list:
    cfg = ModelConfig("gpt", 8, 2048, 16, 32000, 1024, global_batch=8, name="gpt-8x2048")
    best = plan(cfg, 4, cluster=cluster, fix={"pp": 4, "dp": 1, "tp": 1, "mb": 1,
                                              "schedule": "1f1b"})[0]
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda", dtype=DTYPE)
    tokens, targets = example_batch(cfg, 1, device="cuda")
    measured = best.num_microbatches * cuda_time(lambda: model(tokens, targets).backward(), 5)
    predicted = best.num_microbatches * sum(st.time_s for st in best.stages)
    return [f"pipeline {cfg.name}: 4 stages x {best.num_microbatches} micro-batches, serial",
            predicted * 1e3, measured * 1e3, predicted / measured]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-profile.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    cluster = calibrate("cuda", world_sizes=(), out=args.out)
    print(f"calibrated {torch.cuda.get_device_name()} in {time.perf_counter() - t0:.0f} s: "
          f"matmul_eff {cluster.matmul_eff:.2f}, attention_eff {cluster.attention_eff:.2f}, "
          f"bw_eff {cluster.bw_eff:.2f} -> {args.out}")
    rows = [block_row(cluster, *spec) for spec in BLOCKS] + [pipeline_row(cluster)]
    print(tabulate(rows, headers=["item", "predicted ms", "measured ms", "pred/meas"],
                   floatfmt=".3f"))
    errors = [abs(r[3] - 1) for r in rows[:-1]]
    print(f"median |pred/meas - 1| over blocks: {statistics.median(errors):.1%}; "
          f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
