"""How ranks meet: the collectives rewritten graphs call as named nodes (collectives), the device mesh
and its process groups (mesh), the bytes each collective puts on a link (wire), and the per-layer
traffic counters (instrument).

May import: runtime.programs, runtime.launch."""
