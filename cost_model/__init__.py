"""fxpar's cost model: the time and memory of a layer under a strategy, priced from the layer's
rewritten graph. It knows nothing of the search or the ILP (planner/, the floor above); it reads
graphs from passes/ and collective volumes from runtime/ below it.

  ops/          per-FX-node FLOPs, bytes and saved-activation bytes: the rules
  hardware/     clusters and profiles, the presets, runtime profiles, collective and kernel times
  layers/       a layer under a strategy: time, memory, ZeRO bytes, ring attention
  calibration/  `fxpar calibrate`: microbenchmarks and the fits that make a profile

Inside: calibration → layers → hardware → ops (tests/unit/test_floors.py)."""
