"""fxpar's runtime: what a rank runs and how ranks meet. The schedule IR and its generators,
validator and simulator; the stage programs' types (stage.StageProgram) and shard specs; the
executor over torch.distributed point-to-point ops; the trainer (data-parallel sync, tied
parameters, replicas made equal, the batch check, clipping, mixed precision); the collectives
rewritten graphs call and the bytes each puts on the wire; meshes and process groups; the
launcher, fault reports and activity. It imports nothing of the floors above it.

Floors: planner → cost_model → passes → runtime; imports point downward only."""
