"""The pipeline: the schedule IR of per-rank actions and its text form (schedule), its generators —
GPipe, 1F1B, interleaved, ZB-H1 (generators) — the validator (validate), the simulator of a schedule
and of a whole step on shared cores (simulator, step_sim), the executor over torch.distributed
point-to-point ops (executor) and the Chrome-trace timeline (timeline).

May import: runtime.comm, runtime.programs, runtime.launch."""
