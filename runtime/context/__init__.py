"""Context parallelism: exact ring attention over a sequence split across a group (ring_attention).

May import: runtime.comm, runtime.programs, runtime.launch."""
