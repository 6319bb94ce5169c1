"""The types of what a rank runs, made by passes/: a stage program and the specs of the tensors
crossing its edges (stage), how a parameter was cut (shards), which tokens each rank of a
context-parallel group holds (token_split), what a saved-tensor hook may keep (saved).

May import: nothing of the runtime."""
