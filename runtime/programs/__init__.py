"""The types of what a rank runs, made by passes/: a stage program and the specs of the tensors
crossing its edges (stage), how a parameter was cut (shards), which tokens each rank of a
context-parallel group holds (token_split).

May import: nothing of the runtime."""
