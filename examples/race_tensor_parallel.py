"""Race fxpar's tensor parallelism against torch's DTensor tensor parallelism on one Llama.

One Llama (4 blocks: RMSNorm, grouped-query attention with rotary embeddings, SwiGLU), built from
one seed, is trained on `tp` gloo ranks (runtime.launch.ranks.run_local, as fxpar launches them)
with the same optimizer (planner.training.local.make_optimizer) and the same batch, by

  fxpar  the captured graph rewritten tensor-parallel (passes.stages.program.Layout): every block
         "tp" (Megatron's column / row split, one all-reduce after attention and one after the
         MLP) or "tp+sp" (sequence parallel: norms on a slice of the sequence, all-gather before
         and reduce-scatter after each half), embedding and head vocabulary-parallel;
  torch  torch.distributed.tensor.parallel.parallelize_module with the plan torchtitan applies to
         Llama: q/k/v, gate and up ColwiseParallel, o_proj and down RowwiseParallel, the embedding
         RowwiseParallel and the head ColwiseParallel with loss_parallel; under "+sp" the norms
         SequenceParallel, the attention's input and the MLP's (the norm's output) gathered once
         (PrepareModuleInput / PrepareModuleOutput), the row-parallel outputs reduce-scattered.

Steps of both sides (forward, backward, optimizer step) are interleaved in pairs as
runtime.observe.race describes; each pair gives one ratio fxpar / torch (below 1: fxpar is
faster). Both sides' first losses are printed: equal losses say both trained the same model on
the same data.

    python examples/race_tensor_parallel.py [--pairs 5] [--steps 10] [--rows tp2,tp2+sp,...]
    python examples/race_tensor_parallel.py --quick      # 2 pairs of 3 steps, a smoke check
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from runtime.observe.race import arguments, tables

ROWS = {"tp2": (2, False), "tp2+sp": (2, True), "tp4": (4, False), "tp4+sp": (4, True)}


def _config():
    from planner.models.presets import get_config
    return get_config("llama-tiny").with_(layers=4, hidden=256, heads=8, kv_heads=4, ffn=768,
                                          vocab=1024, seq=128, global_batch=16,
                                          name="llama-race-tp")


def _torch_plan(model: torch.nn.Module, tp: int, sp: bool) -> None:
    """torchtitan's Llama tensor-parallel plan, applied in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (tp,))
    stream = Shard(1) if sp else Replicate()  # the residual stream between the blocks
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
           "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                      use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.blocks:
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(
                    output_layouts=stream), "gate": ColwiseParallel(), "up": ColwiseParallel(),
                "down": RowwiseParallel(output_layouts=stream)}
        if sp:
            plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),))}
        parallelize_module(block, mesh, plan)
        if sp:  # gate and up read the norm's output: gather it once, not once per projection
            parallelize_module(block.norm2, mesh, PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate()))


class _Torch:
    def __init__(self, model: torch.nn.Module, tp: int, sp: bool, make_optimizer):
        _torch_plan(model, tp, sp)
        self.model = model
        self.optimizer = make_optimizer(list(model.parameters()))

    def step(self, tokens, targets) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        self.optimizer.zero_grad(set_to_none=True)
        with loss_parallel():  # cross-entropy on the vocabulary-sharded logits
            loss = self.model(tokens, targets)
            loss.backward()
        self.optimizer.step()
        return loss.full_tensor().detach()


def race(rows: list[str], pairs: int, steps: int, warmup: int):
    """Runs on every rank: per row, (rounds of runtime.observe.race.interleave, first losses)."""
    from passes.capture.trace import capture
    from passes.stages.program import Layout, rank_programs
    from planner.models.presets import build_model, example_batch
    from planner.training.local import make_optimizer
    from runtime.comm.mesh import Mesh, mesh_groups
    from runtime.observe.race import interleave
    from runtime.pipeline.generators import make_schedule
    from runtime.training.trainer import PipelineTrainer

    torch.set_num_threads(1)
    config = _config()
    batch = example_batch(config, config.global_batch)
    torch.manual_seed(0)
    model = build_model(config)
    captured = capture(copy.deepcopy(model), batch)
    groups = mesh_groups(Mesh(1, 1, dist.get_world_size()))
    schedule = make_schedule("gpipe", 1, 1)
    results = {}
    for row in rows:
        tp, sp = ROWS[row]
        mine = copy.deepcopy(captured)
        block = "tp+sp" if sp else "tp"
        layout = Layout(tp, tuple((l.name, block if l.kind == "block" else "tp")
                                  for l in mine.layers), (len(mine.layers),))
        programs = rank_programs(mine, layout, groups.tp_index, (0,))
        ours = PipelineTrainer(programs, schedule, groups, mine.input_names, make_optimizer,
                               tied=mine.tied)
        theirs = _Torch(copy.deepcopy(model), tp, sp, make_optimizer)
        first = {"fxpar": ours.step(*batch), "torch": float(theirs.step(*batch))}
        runners = {"fxpar": lambda: ours.step(*batch), "torch": lambda: theirs.step(*batch)}
        results[row] = (interleave(runners, pairs, steps, warmup), first)
    return results


def main(argv=None) -> None:
    args = arguments(__doc__, ROWS, argv)
    rows = args.rows
    config = _config()
    print(f"{config.name}: {config.layers} blocks, hidden {config.hidden}, {config.heads} heads "
          f"({config.n_kv_heads} kv), SwiGLU {config.ffn_hidden}, vocab {config.vocab}, seq "
          f"{config.seq}, batch {config.global_batch}; tp gloo ranks, one thread each, fp32; "
          f"{args.pairs} pairs x {args.steps} timed steps after {args.warmup} warm-up steps per "
          f"side\n")
    from runtime.launch.ranks import run_local
    results = {}
    for tp in sorted({ROWS[r][0] for r in rows}):
        mine = [r for r in rows if ROWS[r][0] == tp]
        results |= run_local(race, tp, (mine, args.pairs, args.steps, args.warmup),
                             timeout_s=600)[0]
    labels = {row: [f"tp={ROWS[row][0]}" + (" +sp" if ROWS[row][1] else ""),
                    "parallelize_module" + (" +SequenceParallel" if ROWS[row][1] else "")]
              for row in results}
    print(tables(results, labels, ["fxpar", "torch"]))


if __name__ == "__main__":
    main()
