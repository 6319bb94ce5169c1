"""Weights without a whole model on any rank: meta-device models materialised per shard
(materialize), Hugging Face safetensors read per shard and the name map (hf_weights), and
`fxpar export` of a checkpoint as one consolidated model (export).

May import: planner.models; cost_model, passes, runtime."""
