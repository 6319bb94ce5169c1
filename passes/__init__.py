"""fxpar's graph passes, graph in, graph out, plain arguments:

  capture/   torch.fx / torch.export capture with shapes and layers; runs of identical blocks
  rewrite/   tensor, sequence, vocabulary, context and expert parallel; recomputation; checks
  stages/    the pipeline split into the programs one rank runs

The collectives the rewritten graphs call, and the types of what a rank runs (runtime.programs),
live in runtime/, the floor below. Inside: stages → rewrite → capture."""
