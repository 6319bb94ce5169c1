"""Per-operation costs of FX nodes, the bottom of the cost model: the graph facts rules read (graph_facts),
the rules for matmuls, attention and norms (rules), pointwise and other ops by table (tables), the
fallback for unknown ops (fallback), a mixture-of-experts node (moe), ring attention op by op
(ring_attention), and the dispatch from node to rule (node_cost).

May import: passes, runtime — nothing else of the cost model."""
