"""Per-rank peak memory of every plan kind: predicted, measured on gloo ranks, dry-run.

Each case of planner.bench.memory_cases (data parallel at every ZeRO level and hybrid sharding,
tensor and sequence parallel, each pipeline schedule, context and expert parallel, each
recomputation, tied embeddings across stages, autocast mixed precision, bf16 with fp32 main
weights, three Hugging Face families) is planned on cpu-gloo, trained 2 steps under the tensor tracker on real gloo ranks
(the first step left out) and dry-run rank by rank on fake tensors. The table is the one in
docs/fidelity.md ("Memory per rank"); tests/dist/test_memory.py holds every row to it.

    python examples/bench_memory_plans.py [--only NAME ...]      # about 3 minutes
"""
from __future__ import annotations

import argparse

from planner.bench.memory_cases import CASES, cases_table, run_case
from runtime.launch.ranks import RankPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=(), help="cases whose name contains one")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.only or any(n in c.name for n in args.only)]
    pools: dict[int, RankPool] = {}
    try:
        results = []
        for case in cases:
            if case.gpus not in pools:
                pools[case.gpus] = RankPool(case.gpus, timeout_s=120)
            results.append(run_case(case, pools[case.gpus]))
            print(f"{case.name}: {results[-1].plan_text}", flush=True)
        print(cases_table(results))
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
