"""The main job: plan a small GPT for 8 GPUs, then train the plan for 3 steps on 8 gloo CPU processes
standing in for the GPUs, each step's loss beside the same model trained in one process."""
from planner.api import plan
from planner.models import get_config
from planner.train import compare_with_reference


def main() -> None:
    config = get_config("gpt-tiny")
    print(f"model {config.name}: {config.layers} layers, hidden {config.hidden}, {config.heads} "
          f"heads, vocab {config.vocab}, seq {config.seq}, global batch {config.global_batch}\n")
    best = plan(config, 8, cluster="cpu-gloo")[0]
    print(best, "\n")
    compare_with_reference(config, best, steps=3)
    # The fastest plan for so small a model on CPUs is often plain data parallelism; a plan that
    # uses all three axes shows the tensor-parallel rewrite and the 1F1B pipeline at work too.
    mixed = plan(config, 8, cluster="cpu-gloo", fix={"dp": 2, "tp": 2, "pp": 2, "mb": 2, "strategy": "tp"})[0]
    print("\nthe same model under a fixed dp=2 x tp=2 x pp=2 plan:\n")
    print(mixed, "\n")
    compare_with_reference(config, mixed, steps=3)


if __name__ == "__main__":
    main()
