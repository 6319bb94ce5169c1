"""Training a plan on local gloo ranks: beside the same model in one process, step by step (local,
behind `make demo` and `fxpar run`), models no rank holds whole (pretrained), and checkpoints
resumed under any plan (resume).

`fxpar train CONFIG.toml`, one job per module: its and `fxpar data`'s arguments (commands), the config and its checks (config), the model it
names (model_spec), token files and their batches (data; tokenizer and prepare behind `fxpar data
prepare`), the learning rate of each step (schedule), AdamW's parameter groups (optimizer), what
rank 0 reports (metrics), the loop on every rank (train; worker is its torchrun entry point), and
the checks before any rank starts and the launch with torchrun's engine (launch).

May import: planner.api, planner.weights, planner.search, planner.models; the floors below."""
