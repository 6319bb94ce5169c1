"""The rewrites, graph in, graph out: tensor, sequence, vocabulary, context and expert parallel
(tensor_parallel, sequence_parallel, vocab_parallel, context_parallel with cp_masks and cp_trial,
expert_parallel), recomputation (recompute), the whole step's token mean (token_mean), what the
rewrites share (sharding, tables), and the dataflow check that proves a tensor-parallel rewrite
exact (tp_dataflow).

May import: passes.capture; runtime."""
