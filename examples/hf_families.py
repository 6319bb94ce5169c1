"""The table of Hugging Face architectures: does each family plan, does it train exactly.

For every family of planner.models.hf_families (small configs, no download): plan it from its
config.json as `fxpar plan --hf-config` does (seconds), then train 2 steps under tp=2 x pp=2 and
cp=2 x pp=2 on 4 local gloo ranks beside one process and compare losses, every gradient and the
final parameters (rtol 1e-5). An axis the family cannot use shows the planner's refusal.

    python examples/hf_families.py [ARCH ...]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

from planner.api import plan
from planner.search.costs import PlanningError
from planner.models.hf import build_hf_from_file, small_config
from planner.models.hf_families import FAMILIES
from planner.training.local import HFSpec, assert_same_run, build, reference_run, run_parallel
from runtime.launch.ranks import RankPool

MESHES = {"tp=2 x pp=2": {"tp": 2, "pp": 2, "cp": 1, "strategy": "tp"},
          "cp=2 x pp=2": {"cp": 2, "pp": 2, "tp": 1}}


def plans_from_file(family, folder: Path) -> str:
    path = folder / f"{family.arch}.json"
    small_config(family.arch, **dict(family.overrides)).to_json_file(str(path))
    start = time.perf_counter()
    with torch.device("meta"):
        model = build_hf_from_file(str(path))
    tokens = torch.zeros(8, 32, dtype=torch.long, device="meta")
    chosen = plan(model, 4, (tokens, tokens), cluster="cpu-gloo")[0]
    mesh = f"dp={chosen.dp} tp={chosen.tp} pp={chosen.pp} cp={chosen.cp}"
    return f"yes ({mesh}, {time.perf_counter() - start:.1f} s)"


def trains_exactly(family, mesh: dict, pool: RankPool) -> str:
    spec = HFSpec(family.arch, global_batch=8, overrides=family.overrides, seq=32)
    torch.manual_seed(0)
    model, batch = build(spec)
    start = time.perf_counter()
    try:
        chosen = plan(model, 4, batch, cluster="cpu-gloo",
                      fix={**mesh, "dp": 1, "mb": 2, "schedule": "1f1b"})[0]
    except PlanningError as err:
        return f"refused: {str(err)[:90]}"
    try:
        assert_same_run(run_parallel(spec, chosen, 2, pool), reference_run(spec, 2))
    except AssertionError as err:
        return f"NO: {str(err).splitlines()[0][:90]}"
    return f"yes ({time.perf_counter() - start:.1f} s)"


def main(archs: list[str]) -> None:
    families = [f for f in FAMILIES if not archs or f.arch in archs]
    pool = RankPool(4, timeout_s=120)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for family in families:
                row = [family.arch, plans_from_file(family, Path(folder))]
                row += [trains_exactly(family, mesh, pool) for mesh in MESHES.values()]
                rows.append(row + [family.exercises])
                print(" | ".join(row), flush=True)
    finally:
        pool.close()
    print(tabulate(rows, headers=["architecture", "plans (--hf-config, 4 GPUs)",
                                  *(f"trains exactly, {m}" for m in MESHES), "exercises"],
                   tablefmt="github"))


if __name__ == "__main__":
    main(sys.argv[1:])
