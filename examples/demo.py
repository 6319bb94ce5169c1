"""The main job: plan a small GPT for 8 GPUs, then train the plan for 3 steps on 8 gloo CPU processes
standing in for the GPUs, each step's loss beside the same model trained in one process."""
from planner.api import plan
from planner.models.presets import get_config
from planner.training.local import compare_with_reference


def main() -> None:
    config = get_config("gpt-tiny")
    print(f"model {config.name}: {config.layers} layers, hidden {config.hidden}, {config.heads} "
          f"heads, vocab {config.vocab}, seq {config.seq}, global batch {config.global_batch}\n")
    best = plan(config, 8, cluster="cpu-gloo")[0]
    print(best, "\n")
    compare_with_reference(config, best, steps=3)
    # For so small a model on CPUs the fastest plan uses few axes; a fixed plan that uses tensor,
    # pipeline and context parallelism at once shows those rewrites and the 1F1B pipeline at work.
    fixed = {"tp": 2, "pp": 2, "cp": 2, "mb": 2, "strategy": "tp", "schedule": "1f1b"}
    mixed = plan(config, 8, cluster="cpu-gloo", fix=fixed)[0]
    print("\nthe same model under a fixed tp=2 x pp=2 x cp=2 plan (1F1B):\n")
    print(mixed, "\n")
    compare_with_reference(config, mixed, steps=3)

if __name__ == "__main__":
    main()
