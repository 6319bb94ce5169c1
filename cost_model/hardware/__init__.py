"""The hardware: the Cluster spec (spec), the presets (presets), profiles on disk and by name
(cluster), the runtime profiles (runtimes), alpha-beta times of
collectives (comm), and the roofline time of a kernel on one device (compute).

May import: cost_model.ops (its backward-factor constants); passes, runtime."""
