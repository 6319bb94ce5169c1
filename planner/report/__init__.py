"""What a plan says to a person: why the planner chose it, the alternatives and plan diffs (explain),
and its pictures — the predicted pipeline timeline and the layers and memory per stage (pictures).

May import: planner.search, planner.models; cost_model, passes, runtime."""
