"""The price of one layer under one strategy (layer_cost): the strategy itself (strategy), ring
attention inside a layer (ring_pricing), pointwise chains run fused (fusion), sharded data parallel bytes and traffic (sharding), and the
bytes per parameter training keeps (memory).

May import: cost_model.hardware, cost_model.ops; passes, runtime."""
