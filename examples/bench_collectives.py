"""Predicted vs measured collective times on this machine.

    python examples/bench_collectives.py --cluster out/cpu.json

Predicts each collective with `cost_model.hardware.comm.collective_time` for the given
preset or profile, measures it in real process groups (gloo on CPU) with the
harness calibration uses (`cost_model.calibration.bench_comm.measure_collectives`: the
fastest of interleaved rounds, same warm-up, same clock), and prints both
with the median |predicted / measured - 1|. The default sizes lie between
the ones calibration uses, so a calibrated profile is checked on data it was
not fitted to.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

# Run from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabulate import tabulate  # noqa: E402

from cost_model.calibration.bench_comm import ROUNDS, measure_collectives  # noqa: E402
from cost_model.calibration.calibrate import format_bytes  # noqa: E402
from cost_model.hardware.cluster import get_cluster  # noqa: E402
from cost_model.hardware.comm import KINDS, collective_time  # noqa: E402

KiB, MiB = 2**10, 2**20
DEFAULT_SIZES = (16 * KiB, 256 * KiB, 2 * MiB, 8 * MiB)


def run(cluster_name: str, sizes, world_sizes, kinds, rounds: int = ROUNDS) -> list[dict]:
    cluster = get_cluster(cluster_name)
    device = "cuda" if cluster.device == "cuda" else "cpu"
    plan = [(kind, size) for kind in kinds for size in sizes]
    rows = []
    for n in world_sizes:
        print(f"measuring {len(plan)} collectives with n={n} ...", file=sys.stderr, flush=True)
        measured = measure_collectives(plan, n, device, rounds=rounds)
        for (kind, size), meas in zip(plan, measured):
            # stride 1: the measured group is ranks 0..n-1 on this host.
            pred = collective_time(cluster, kind, size, n, stride=1)
            rows.append(dict(kind=kind, n=n, size=format_bytes(size), predicted_ms=pred * 1e3,
                             measured_ms=meas * 1e3, ratio=pred / meas))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="cpu-gloo", help="preset name or profile JSON path")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="message sizes in bytes")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="timed rounds per collective (the fastest counts, as in calibration)")
    args = parser.parse_args(argv)
    rows = run(args.cluster, args.sizes, args.world_sizes, args.kinds, args.rounds)
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    errors = [abs(r["ratio"] - 1) for r in rows]
    print(f"\nmedian |pred/meas - 1| = {statistics.median(errors):.1%} over {len(rows)} "
          f"measurements (cluster: {args.cluster})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
