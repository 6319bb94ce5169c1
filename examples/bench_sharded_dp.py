"""Sharded data parallel, measured beside its price: for ZeRO levels 0-3 on a few meshes of 4
gloo ranks, the bytes each rank holds after a step (parameters, gradients, optimizer states, read
from the tensors) and the bytes it sends per collective kind in one step (runtime.data_parallel.sharded_dp's
counters; level 0 from the all-reduce buckets' sizes), each beside cost_model.layers.sharding's figure
for the plan's layers, and the step time measured relative to level 0.

    python examples/bench_sharded_dp.py            # gpt-tiny, 4 layers; about a minute
    python examples/bench_sharded_dp.py --layers 8 --meshes dp4
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from tabulate import tabulate

from planner.api import plan
from planner.models.presets import build_model, example_batch, get_config
from planner.training.local import make_optimizer
from planner.search.zero import gpt_layer_numels, priced_stage
from runtime.launch.ranks import run_local

MESHES = {"dp4": dict(dp=4, mb=2), "dp2-pp2-zb": dict(dp=2, pp=2, mb=2, schedule="zb-h1"),
          "hsdp2x2": dict(dp=4, mb=2)}
STEPS = 3


def worker(config, plan_jsons: list[str]):
    """Per plan: (pp index, held bytes, bytes sent per kind in the last step, seconds per step)."""
    from planner.api import ParallelModel
    from planner.search.plan import Plan
    from runtime.data_parallel import sharded_dp

    torch.set_num_threads(1)
    out = []
    for text in plan_jsons:
        torch.manual_seed(0)
        chosen = Plan.from_json(text)
        cfg = config.with_(global_batch=chosen.global_batch)
        model, batch = build_model(cfg), example_batch(cfg, chosen.global_batch)
        pm = ParallelModel(model, chosen, [], batch, make_optimizer)
        pm.train_step(*batch)  # warm-up: the optimizer's states appear on the first step
        start = time.perf_counter()
        for _ in range(STEPS - 1):
            sharded_dp.TRAFFIC.clear()
            pm.train_step(*batch)
        seconds = (time.perf_counter() - start) / (STEPS - 1)
        trainer = pm.shard()
        states = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                     for t in s.values() if torch.is_tensor(t))
        if trainer.sharded is not None:
            held = {"params": trainer.sharded.param_bytes(),
                    "grads": trainer.sharded.grad_bytes(), "optimizer": states}
            sent = dict(sharded_dp.TRAFFIC)
        else:  # level 0: the all-reduce buckets (runtime.training.trainer._GradSync)
            params = [p for prog in trainer.programs.values() for p in prog.gm.parameters()]
            buckets = [b for bs in (trainer.sync.buckets.values() if trainer.sync else [])
                       for b in bs]
            held = {"params": sum(p.numel() * p.element_size() for p in params),
                    "grads": sum(b.flat.numel() * b.flat.element_size() for b in buckets),
                    "optimizer": states}
            n = trainer.groups.num_replicas
            sent = {"all_reduce": sum(2 * (n - 1) / n * b.flat.numel() * b.flat.element_size()
                                      for b in buckets)}
        out.append((trainer.groups.pp_index, held, sent, seconds))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--meshes", default=",".join(MESHES), help=f"of {', '.join(MESHES)}")
    args = ap.parse_args(argv)
    config = get_config("gpt-tiny").with_(layers=args.layers)
    cases, plans = [], []
    for mesh in args.meshes.split(","):
        fix = MESHES[mesh]
        batch = fix["dp"] * fix["mb"] * (4 if "pp" in fix else 1)
        base = plan(config.with_(global_batch=batch), 4, cluster="cpu-gloo",
                    fix={"tp": 1, "pp": 1, "cp": 1, **fix, "zero": 0})[0]
        for level in ((1, 2, 3) if mesh.startswith("hsdp") else (0, 1, 2, 3)):
            shard = 2 if mesh.startswith("hsdp") else None
            cases.append((mesh, level))
            plans.append(replace(base, zero=level, dp_shard=shard))
    results = run_local(worker, 4, (config, [p.dumps() for p in plans]))
    rows, timing, numels = [], {}, gpt_layer_numels(build_model(config))
    for i, ((mesh, level), chosen) in enumerate(zip(cases, plans)):
        for rank, per_rank in enumerate(results):
            stage, held, sent, seconds = per_rank[i]
            want_held, want_sent = priced_stage(numels, chosen, stage)
            timing.setdefault((mesh, level), []).append(seconds)
            if rank not in (0, 3):
                continue  # ranks 0 and 3: the first and (with pp) the last stage
            cells = [f"{held[k]:,.0f} / {want_held[k]:,.0f}" for k in
                     ("params", "grads", "optimizer")]
            cells += [f"{sent.get(k, 0):,.0f} / {want_sent.get(k, 0):,.0f}"
                      for k in ("reduce_scatter", "all_gather", "all_reduce")]
            exact = all(held[k] == want_held[k] for k in held) and all(
                abs(sent.get(k, 0) - want_sent.get(k, 0)) < 1e-6 for k in want_sent)
            rows.append([mesh, level, rank, *cells, "yes" if exact else "NO"])
    print("bytes per rank, measured / priced (cost_model.layers.sharding)")
    print(tabulate(rows, headers=["mesh", "zero", "rank", "params", "grads", "optimizer",
                                  "reduce-scatter/step", "all-gather/step", "all-reduce/step",
                                  "equal"], disable_numparse=True))
    print("\nstep time relative to zero=0 on the same mesh (slowest rank, 2 timed steps)")
    base = {mesh: max(t) for (mesh, level), t in timing.items() if level == 0}
    print(tabulate([[mesh, level, f"{max(t) / base[mesh]:.2f}" if mesh in base else "-"]
                    for (mesh, level), t in timing.items()],
                   headers=["mesh", "zero", "time / zero=0"], disable_numparse=True))


if __name__ == "__main__":
    main()
