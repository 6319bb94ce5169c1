"""The hardware: the Cluster spec, presets and calibrated profiles (cluster), alpha-beta times of
collectives (comm), and the roofline time of a kernel on one device (compute).

May import: cost_model.ops (its backward-factor constants); passes, runtime."""
