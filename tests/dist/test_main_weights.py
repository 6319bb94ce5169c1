"""Precision "bf16-main" (runtime.training.main_weights): a model trained in bf16 with fp32 main
weights on 4 gloo ranks, under tensor x data parallel and under ZeRO-1, trains as one process
running the same policy written out by hand (the model cast to bf16, an fp32 copy of every weight
stepped by the optimizer and rounded back): the same losses and final weights, within bf16's
rounding of a different summation order; asked for, or chosen by precision "auto" for a model
given in bf16. Each rank holds bf16 weights and gradients and fp32 optimizer states, main copy
included."""
import pytest
import torch

from planner.api import plan
from planner.models.presets import build_model, example_batch, get_config
from planner.search.plan import Plan
from planner.training.local import make_optimizer
from runtime.training.main_weights import MAIN_KEY, compute_inputs

SPEC = get_config("gpt-tiny").with_(global_batch=8)
STEPS = 3


def _by_hand(steps: int):
    """One process: bf16 model, fp32 main copies stepped by the same optimizer."""
    torch.manual_seed(0)
    model = build_model(SPEC).to(torch.bfloat16)
    batch = compute_inputs(example_batch(SPEC, SPEC.global_batch))
    params = list(model.parameters())
    main = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = make_optimizer(main)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = model(*batch)
        loss.backward()
        for m, p in zip(main, params):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(main, params):
                p.copy_(m)
        losses.append(loss.item())
    names = [k for k, _ in model.named_parameters()]
    return (losses, {k: v.detach().float() for k, v in model.named_parameters()},
            {k: m.detach() for k, m in zip(names, main)})


def _worker(plan_json: str, steps: int, auto: bool, folder: str):
    """auto: the model given in bf16 with the default options (precision "auto" picks
    bf16-main for bf16 weights); else in fp32 with precision "bf16-main" asked for."""
    from planner.api import ParallelModel
    from runtime.training.trainer import TrainOptions
    torch.manual_seed(0)
    model = build_model(SPEC)
    batch = example_batch(SPEC, SPEC.global_batch)
    if auto:
        model = model.to(torch.bfloat16)
    options = TrainOptions() if auto else TrainOptions(precision="bf16-main")
    pm = ParallelModel(model, Plan.from_json(plan_json), [], batch, make_optimizer,
                       options=options)
    losses = [pm.train_step(*batch) for _ in range(steps)]
    trainer = pm.shard()
    held = {"weights": {p.dtype for p in trainer.params},
            "grads": {p.grad.dtype for p in trainer.params if p.grad is not None},
            "states": {v.dtype for s in trainer.optimizer.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.dim()},
            "main": all(MAIN_KEY in s for s in trainer.optimizer.state.values())}
    from runtime.checkpoint.state import save
    save(trainer, folder, {"step": steps})
    return losses, {k: v.float() for k, v in pm.full_state_dict().items()}, held


@pytest.mark.dist
@pytest.mark.parametrize("fix,auto", [({"tp": 2, "dp": 2, "strategy": "tp"}, False),
                                      ({"dp": 4, "zero": 1}, True),
                                      ({"dp": 2, "pp": 2, "schedule": "zb-h1",
                                        "split_backward": "record"}, False)],
                         ids=["tp2-dp2-asked", "dp4-zero1-auto", "pp2-zb-h1-record"])
def test_trains_as_the_policy_written_out(pool4, fix, auto, tmp_path):
    chosen = plan(SPEC, 4, cluster="cpu-gloo", fix={"pp": 1, "mb": 2, **fix})[0]
    folder = str(tmp_path / "ckpt")
    losses, state, held = pool4.run(_worker, chosen.dumps(), STEPS, auto, folder)[0]
    want_losses, want_state, want_main = _by_hand(STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                               rtol=1e-2, atol=0)  # 2.5 bf16 ulps: the loss is a bf16 value
    for name, value in want_state.items():
        torch.testing.assert_close(state[name], value, rtol=2e-2, atol=2e-2, msg=name)
    _moved_as_far(state, want_state)
    assert held == {"weights": {torch.bfloat16}, "grads": {torch.bfloat16},
                    "states": {torch.float32}, "main": True}
    _exports_weights_and_main_copies(folder, tmp_path, state, want_main)


def _moved_as_far(state, want_state) -> None:
    """Every step's update applied: the weights moved from their start as the one process's did
    (a step whose update is lost moves them a third less over three steps, within the absolute
    tolerance above but not within this one)."""
    torch.manual_seed(0)
    start = {k: v.detach().to(torch.bfloat16).float()
             for k, v in build_model(SPEC).named_parameters()}
    moved = torch.cat([(state[k] - start[k]).flatten() for k in start])
    want = torch.cat([(want_state[k] - start[k]).flatten() for k in start])
    assert (moved - want).norm() < 0.2 * want.norm(), ((moved - want).norm(), want.norm())


def _exports_weights_and_main_copies(folder, tmp_path, state, want_main) -> None:
    """`fxpar export` writes the bf16 weights as trained and says the fp32 main copies are in
    the checkpoint; with --main-weights it writes those, as the one process holds them."""
    from safetensors.torch import load_file

    from planner.weights.export import export, export_line
    path, count, _ = export(folder, str(tmp_path / "w.safetensors"))
    assert "--main-weights exports those" in export_line("w", path, count, False, False)
    weights = load_file(str(tmp_path / "w.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    for name, value in weights.items():
        torch.testing.assert_close(value.float(), state[name], rtol=0, atol=0, msg=name)
    export(folder, str(tmp_path / "main.safetensors"), main_weights=True)
    main = load_file(str(tmp_path / "main.safetensors"))
    assert {v.dtype for v in main.values()} == {torch.float32}
    for name, value in want_main.items():
        torch.testing.assert_close(main[name], value, rtol=2e-2, atol=2e-2, msg=name)
        torch.testing.assert_close(main[name].to(torch.bfloat16), weights[name], rtol=0, atol=0,
                                   msg=name)
