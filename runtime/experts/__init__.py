"""Expert parallelism: top-k routing with dropless dispatch to the experts' ranks (dispatch), and the
routed experts as one custom op that capture keeps whole (custom_op).

May import: runtime.comm, runtime.programs, runtime.launch."""
