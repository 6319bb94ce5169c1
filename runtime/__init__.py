"""fxpar's runtime: what a rank runs and how ranks meet. It imports nothing of the floors above.

  programs/       the types passes/ produce: stage programs, shard specs, token layouts
  launch/         torchrun or local gloo ranks, the pool of ranks, fault reports, progress
  attention/      attention kernels kept one graph node: causal attention with sinks (GPT-OSS)
  comm/           collectives as graph nodes, the device mesh, bytes on the wire, counters
  pipeline/       the schedule IR, its generators, validator, simulators, executor, timeline
  data_parallel/  ZeRO 1-3 / FSDP over flat buckets, replicas made equal
  experts/        expert-parallel dispatch and the routed-experts op
  context/        ring attention
  training/       one training iteration on a rank: sync, tied weights, batch check, RNG
  checkpoint/     DCP checkpoints under any plan
  observe/        measurement runs and the split of a measured step

Inside, highest first: observe → checkpoint → training → {pipeline, data_parallel, experts,
context} → comm → {programs, launch, attention} (tests/unit/test_floors.py)."""
