"""The search: every mesh (dp, tp, cp, pp), micro-batching and schedule (meshes), the stage ILP
(ilp), the ZeRO and expert-parallel axes (zero, experts), the layer profiles priced on demand
(costs), the whole-step prediction (step_prediction), why nothing plans (refusals), and the frozen
Plan a solved candidate becomes (solved, plan).

May import: planner.models; cost_model, passes, runtime."""
