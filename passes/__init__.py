"""fxpar's graph passes: capture (torch.fx / torch.export, fake shapes, layers, tied parameters),
the rewrites — tensor, vocabulary, sequence and context parallel, recomputation — with the
dataflow check that proves a tensor-parallel rewrite exact, and the pipeline split into stage
programs (`program.rank_programs`, `program.build_pipeline_trainer`). Graph in, graph out, plain
arguments. The collectives the rewritten graphs call, and the types of what a rank runs
(runtime.stage, runtime.shards), live in runtime/, the floor below.

Floors: planner → cost_model → passes → runtime; imports point downward only."""
