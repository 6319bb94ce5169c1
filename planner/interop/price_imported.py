"""`fxpar plan --from-megatron "FLAGS"` and `--from-torchtitan FILE.toml`: price a configuration
written for another framework with fxpar's cost model, beside fxpar's own plan.

The flags or fields become a `planner.interop.configuration.Configuration`: the mesh, micro-batch and schedule
fixed as `--fix` would fix them (the same checks and refusals), and the stage layout the framework
would build: Megatron-LM's even split, `--decoder-first/last-pipeline-num-layers`, the
`--account-for-*-in-pipeline-split` slots or `--pipeline-model-parallel-layout`; torchtitan's
`pipeline_parallel_split_points` or `module_fqns_per_model_part`, else the layers spread evenly.
Recomputation is placed per layer as the framework places it (Megatron's block method: the first
k layers of each stage; torchtitan's integer option: every n-th layer of a rank).

The model comes from --model (with fxpar's size flags) or --hf/--hf-config. Megatron-LM flags
that define the model (sizes, --kv-channels, --swiglu, --normalization, --qk-layernorm, positions,
biases, --rotary-base, --norm-epsilon, the window, tying) must be the model, each given or implied
by its absence (planner.interop.megatron_model): a contradiction is an error naming the flag;
flags of the parallel layout alone are priced as the model, which a note says. torchtitan's
compile prices both plans under the torchtitan-compile profile. Flags that size the training run
(--seq-length, --global-batch-size; torchtitan's seq_len and batch sizes) set it, unless fxpar's
own --seq or --global-batch says otherwise (an error). Flags that do not change the price
(learning rate, data paths, logging, ...) are listed as ignored; any other flag is an error
naming it (all of them in one). Every error is one line, exit status 2.
"""
from __future__ import annotations

import argparse

from cost_model.layers.strategy import Strategy
from planner.interop.emit import model_of_args, pricer_of_args, runtime_of_args
from planner.interop.round_trip import cmd_emit
from planner.report.explain import binding_constraint, diff, explain
from planner.interop.from_megatron import megatron_configuration
from planner.interop.from_torchtitan import torchtitan_configuration
from planner.interop.readers import Imported
from planner.interop.configuration import compare
from planner.search.plan import Plan


def _describe(imp: Imported, priced: Plan) -> str:
    c = imp.config
    lengths = [len(s) for s in c.stages]
    split = (f"{lengths[0]} layers per stage" if len(set(lengths)) == 1
             else "layers per stage " + " ".join(map(str, lengths)))
    tp = "none" if c.tp == 1 else "tp+sp" if all(Strategy.parse(s).sp for st in c.stages
                                                  for s in st) else "tp"
    v = f" v={c.v}" if c.v > 1 else ""
    ep = f" ep={c.ep}" if c.ep > 1 else ""
    return (f"{imp.source} configuration: dp={c.dp} tp={c.tp} pp={c.pp} cp={c.cp}{ep}, "
            f"{c.schedule}{v}, micro-batch {c.micro_batch}, {split}, layers {tp}, "
            f"recomputation {imp.recompute} (as --fix {c.fix_text()}, the stages as given); "
            f"priced at seq {priced.seq} and a global batch of {priced.global_batch}")


def _runtime_note(imp: Imported, runtime: str) -> None:
    """Say which runtime profile prices a compiled configuration (both plans alike)."""
    if imp.runtime is None:
        return
    if runtime == imp.runtime:
        imp.notes.append(f"torch.compile ([compile] enable = true): priced under the {runtime} "
                         f"runtime profile (pointwise chains fused), fxpar's plan too")
    else:
        imp.notes.append(f"torch.compile ([compile] enable = true): priced under the {runtime} "
                         f"runtime profile (--runtime, or CPU ranks), not {imp.runtime}")


def cmd_import(args) -> int:
    _, _, facts = model_of_args(args)
    if args.from_torchtitan:
        imp = torchtitan_configuration(args.from_torchtitan, facts, args.gpus, args.seq,
                                       args.global_batch, args.zero1)
    else:
        imp = megatron_configuration(args.from_megatron, facts, args.gpus, args.seq,
                                     args.global_batch, args.zero1)
    pricer, _ = pricer_of_args(args, seq=imp.seq, global_batch=imp.global_batch, zero1=imp.zero1,
                               runtime=imp.runtime)
    _runtime_note(imp, runtime_of_args(args, imp.runtime))
    theirs = pricer.price(imp.config)
    plans = pricer.best(top_k=args.top_k if args.explain else 1, fix=args.fix)
    ours = plans[0]
    print(_describe(imp, theirs.plan))
    for note in imp.notes:
        print(f"note: {note}")
    if imp.ignored:
        print(f"ignored (no effect on fxpar's price): {', '.join(imp.ignored)}")
    print()
    # fxpar's plan the baseline, in the table's changes as in the line below it
    table = diff(ours, theirs.plan, ("fxpar", imp.source))
    print("fxpar's plan is this configuration" if table == "the plans are identical" else table)
    print()
    print(compare(ours, theirs, f"{imp.source} configuration"))
    print(f"binding constraint of the {imp.source} configuration: "
          f"{binding_constraint(theirs.plan)}")
    print(f"binding constraint of fxpar's plan: {binding_constraint(ours)}")
    if args.explain:
        print()
        print(explain(plans))
    return 0


def cmd_portable(args, build_config, build_hf) -> int:
    """--emit, --from-megatron and --from-torchtitan (one at a time); `build_config(args)` and
    `build_hf(args)` make the model from fxpar's own flags, as `fxpar plan` does."""
    args = argparse.Namespace(**{**vars(args), "build_config": build_config,
                                 "build_hf": build_hf})
    given = [flag for flag, on in (("--emit", args.emit),
                                   ("--from-megatron", args.from_megatron is not None),
                                   ("--from-torchtitan", args.from_torchtitan)) if on]
    if len(given) > 1:
        raise ValueError(f"{given[0]} and {given[1]} are exclusive: give one")
    for flag, on in (("--json", args.json), ("--png", args.png)):
        if on:
            raise ValueError(f"{flag} does not go with {given[0]}")
    if args.emit:
        return cmd_emit(args)
    return cmd_import(args)

