"""Training a plan on local gloo ranks: beside the same model in one process, step by step (local,
behind `make demo` and `fxpar run`), models no rank holds whole (pretrained), and checkpoints
resumed under any plan (resume).

May import: planner.api, planner.weights, planner.search, planner.models; the floors below."""
