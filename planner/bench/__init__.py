"""Measurement: `fxpar bench` (plans: the top plans run and compared with their predictions; explain:
where a measured step went), the runtime and ring-attention probes `fxpar calibrate` runs on CPU
ranks (runtime_probes, ring_probe), and set-up memory of a model no rank holds whole (setup_memory).

May import: planner.training, planner.api and everything of the planner below them; the floors below."""
