"""Data parallelism: sharded data parallel, ZeRO 1-3 over flat buckets with hybrid sharding
(sharded_dp), ZeRO-3's stage-program edits (zero3_graph), and replicas made equal at set-up (replicas).

May import: runtime.comm, runtime.programs, runtime.launch."""
