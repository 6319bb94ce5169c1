"""fxpar's cost model: clusters (presets and calibrated profiles, `fxpar calibrate`), FLOPs, bytes
and saved-activation bytes per FX node, and the time and memory of a layer under a strategy,
priced from the layer's rewritten graph. It knows nothing of the search or the ILP (planner/, the
floor above); it reads graphs from passes/ and collective volumes from runtime/ below it.

Floors: planner → cost_model → passes → runtime; imports point downward only."""
