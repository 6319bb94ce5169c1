"""Race fxpar's data parallelism (zero 0-3) against torch's own components on the same model.

One GPT, built from one seed, is trained on 4 gloo ranks (runtime.launch.ranks.run_local, as
fxpar launches them) by fxpar (runtime.training.trainer.PipelineTrainer, dp=4, one stage, one
micro-batch) and by torch's data-parallel component each row names, with the same optimizer
(planner.training.local.make_optimizer) and the same global batch (each rank its quarter):

  zero 0  vs  DistributedDataParallel (its defaults: 25 MiB buckets, 1 MiB first bucket)
  zero 1  vs  DistributedDataParallel + ZeroRedundancyOptimizer (optimizer states sharded,
              gradients all-reduced whole, parameters broadcast by their owner after the step)
  zero 2  vs  FSDP2 fully_shard per block + root, reshard_after_forward=False: the nearest peer
              torch has (gradients reduce-scattered in backward, sharded optimizer step,
              parameters gathered once per step and kept through backward); FSDP2 gathers them
              before the forward from its shards where fxpar's level 2 all-gathers them after the
              step, the same bytes
  zero 3  vs  FSDP2 fully_shard per block + root, reshard_after_forward=True (parameters
              gathered again for backward, as fxpar's level 3 does) and =False

A step is one training iteration (forward, backward, gradient sync, optimizer step); the steps
of both sides are interleaved in pairs as runtime.observe.race describes, each pair giving one
ratio fxpar / torch (below 1: fxpar is faster); the table gives its median over the pairs and
its spread (min-max). Both sides' first losses (the mean over the global
batch) are printed: equal losses say both trained the same model on the same data. fxpar's step
also returns the loss to every rank (one extra all-reduce of a scalar), which torch's does not.

    python examples/race_data_parallel.py [--pairs 5] [--steps 10] [--rows zero0-ddp,...]
    python examples/race_data_parallel.py --quick      # 2 pairs of 3 steps, a smoke check
"""
from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist

from runtime.observe.race import arguments, tables

WORLD = 4


def _config():
    from planner.models.presets import get_config
    return get_config("gpt-tiny").with_(layers=4, hidden=256, heads=8, vocab=1024, seq=128,
                                        global_batch=16, name="gpt-race-dp")


# row name -> (fxpar zero level, torch peer)
ROWS = {
    "zero0-ddp": (0, "ddp"),
    "zero1-zero_redundancy": (1, "ddp+zero_redundancy"),
    "zero2-fsdp2-keep": (2, "fsdp2 reshard=False"),
    "zero3-fsdp2-reshard": (3, "fsdp2 reshard=True"),
    "zero3-fsdp2-keep": (3, "fsdp2 reshard=False"),
}


class _Torch:
    """The model under one of torch's data-parallel components; step() trains one iteration on
    this rank's part of the batch and returns its local mean loss."""

    def __init__(self, model: torch.nn.Module, peer: str, make_optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        if peer.startswith("ddp"):
            self.model = DistributedDataParallel(model)
            params = list(self.model.parameters())
            if peer == "ddp+zero_redundancy":
                # The same optimizer as make_optimizer's, its defaults passed through.
                probe = make_optimizer([torch.nn.Parameter(torch.zeros(1))])
                self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=type(probe),
                                                         **probe.defaults)
            else:
                self.optimizer = make_optimizer(params)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            keep = peer.endswith("False")
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
            fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
            self.model = model
            self.optimizer = make_optimizer(list(model.parameters()))

    def step(self, tokens, targets) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(tokens, targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def race(rows: list[str], pairs: int, steps: int, warmup: int):
    """Runs on every rank: per row, (per pair {side: [(wall s, CPU s) per step]}, first losses)."""
    from passes.capture.trace import capture
    from passes.stages.program import build_pipeline_trainer
    from planner.models.presets import build_model, example_batch
    from planner.training.local import make_optimizer
    from runtime.comm.mesh import Mesh, mesh_groups
    from runtime.observe.race import interleave
    from runtime.pipeline.generators import make_schedule
    from runtime.training.trainer import TrainOptions

    torch.set_num_threads(1)
    config = _config()
    batch = example_batch(config, config.global_batch)
    rank = dist.get_rank()
    local = [t.chunk(WORLD)[rank] for t in batch]
    torch.manual_seed(0)
    model = build_model(config)
    captured = capture(copy.deepcopy(model), tuple(t[:len(local[0])] for t in batch))
    groups = mesh_groups(Mesh(1, WORLD, 1))
    results = {}
    for row in rows:
        level, peer = ROWS[row]
        ours = build_pipeline_trainer(copy.deepcopy(captured), make_schedule("gpipe", 1, 1),
                                      groups, make_optimizer, TrainOptions(zero=level))
        theirs = _Torch(copy.deepcopy(model), peer, make_optimizer)
        first = {"fxpar": ours.step(*batch)}
        loss = theirs.step(*local)
        dist.all_reduce(loss)
        first["torch"] = float(loss) / WORLD
        runners = {"fxpar": lambda: ours.step(*batch), "torch": lambda: theirs.step(*local)}
        rounds = interleave(runners, pairs, steps, warmup)
        results[row] = (rounds, first)
        del ours, theirs, runners
        gc.collect()
    return results


def main(argv=None) -> None:
    args = arguments(__doc__, ROWS, argv)
    rows = args.rows
    config = _config()
    print(f"{config.name}: {config.layers} blocks, hidden {config.hidden}, {config.heads} heads, "
          f"vocab {config.vocab}, seq {config.seq}, global batch {config.global_batch}; "
          f"dp={WORLD} gloo ranks, one thread each, fp32; {args.pairs} pairs x {args.steps} "
          f"timed steps after {args.warmup} warm-up steps per side\n")
    from runtime.launch.ranks import run_local
    results = run_local(race, WORLD, (rows, args.pairs, args.steps, args.warmup),
                        timeout_s=600)[0]
    labels = {row: [f"zero {ROWS[row][0]}", ROWS[row][1]] for row in results}
    print(tables(results, labels, ["fxpar", "torch"]))


if __name__ == "__main__":
    main()
