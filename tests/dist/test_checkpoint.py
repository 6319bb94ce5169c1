"""Checkpoints (runtime.checkpoint.state, torch.distributed.checkpoint) on real gloo ranks: a resumed run
continues bit for bit in new processes; a checkpoint saved under dp=2 x tp=2 x pp=2 resumes under
other tp, pp, cp and numbers of ranks as one process would have continued; a save killed mid-write
leaves the previous checkpoint the one a resume picks."""
import os

import pytest
import torch

from planner.api import plan
from planner.models.presets import get_config
from planner.training.resume import reference_steps, run_with_checkpoints
from runtime.checkpoint import state as checkpoint
from runtime.launch.ranks import RankFailure, run_local

# A GPT with a fused QKV weight (3 chunks per tp shard), a head tied to the embedding (held by the
# first and last stages), and a vocabulary of 250, which tp=4 pads to 252.
CONFIG = get_config("gpt-tiny").with_(layers=4, vocab=250, tie=True, global_batch=8)
SAVED_AT, STEPS = 2, 4


def fixed(config, **mesh):
    gpus = mesh["dp"] * mesh["tp"] * mesh["pp"] * mesh.get("cp", 1)
    return plan(config, gpus, cluster="cpu-gloo", fix={**mesh, "mb": 1, "strategy": "tp"})[0]


def assert_same(got: dict, want: dict, **tolerance):
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerance,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.dist
def test_resume_in_new_processes_is_bit_identical(pool4, tmp_path):
    """4 steps in one go (saving at step 2) == the checkpoint of step 2 loaded in freshly started
    processes and 2 more steps (AdamW, so the optimizer's step count and both moments must come
    back)."""
    from planner.training.resume import checkpoint_worker
    chosen = fixed(CONFIG, dp=1, tp=2, pp=2)
    root = str(tmp_path)
    whole = run_with_checkpoints(CONFIG, chosen, STEPS, root, save_every=SAVED_AT,
                                 optimizer="adamw", pool=pool4)
    saved = checkpoint.step_dir(root, SAVED_AT)
    assert whole.saved == (saved, checkpoint.step_dir(root, STEPS))
    # New processes, seeded otherwise: weights, optimizer and generator all come from step 2.
    args = (CONFIG, chosen.dumps(), STEPS, saved, 0, True, "adamw", 1)
    resumed = run_local(checkpoint_worker, 4, args)[0]
    assert resumed.first_step == SAVED_AT
    assert resumed.losses == whole.losses[SAVED_AT:]       # bit for bit
    assert resumed.draw == whole.draw
    for name, value in whole.state.items():
        assert torch.equal(resumed.state[name], value), name


@pytest.fixture(scope="module")
def saved_8(tmp_path_factory):
    """2 steps under dp=2 x tp=2 x pp=2, saved; and 4 steps of the same run in one process."""
    from conftest import rank_pool
    root = str(tmp_path_factory.mktemp("ckpt"))
    run_with_checkpoints(CONFIG, fixed(CONFIG, dp=2, tp=2, pp=2), SAVED_AT, root,
                         save_every=SAVED_AT, pool=rank_pool(8))
    return root, reference_steps(CONFIG, STEPS)


RESHARD = {
    "tp4-pp2": dict(dp=1, tp=4, pp=2),          # vocabulary padded; other tp shards
    "tp2-pp4": dict(dp=1, tp=2, pp=4),          # other stage cuts
    "cp2-tp2-pp2": dict(dp=1, tp=2, pp=2, cp=2),
    "4-ranks-dp2-pp2": dict(dp=2, tp=1, pp=2),  # whole tensors joined from tp shards
    "zero1-dp4-pp2": dict(dp=4, tp=1, pp=2, zero=1),  # optimizer states as flat ZeRO ranges
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(RESHARD))
def test_resume_under_another_mesh_continues_as_one_process(saved_8, name):
    from conftest import rank_pool
    root, reference = saved_8
    mesh = RESHARD[name]
    chosen = fixed(CONFIG, **mesh)
    resumed = run_with_checkpoints(CONFIG, chosen, STEPS, root, resume=True,
                                   pool=rank_pool(chosen.gpus))
    assert resumed.first_step == SAVED_AT and resumed.zero == mesh.get("zero", 0)
    torch.testing.assert_close(torch.tensor(resumed.losses),
                               torch.tensor(reference.losses[SAVED_AT:]), rtol=1e-5, atol=0)
    assert_same(resumed.state, reference.state, rtol=1e-5, atol=1e-6)


CLI_CONFIG = get_config("gpt-tiny").with_(layers=2, global_batch=8)
CLI_MESH = ["--model", "gpt-tiny", "--layers", "2", "--global-batch", "8", "--gpus", "4",
            "--fix", "dp=1,tp=2,pp=2,mb=1,strategy=tp"]


@pytest.mark.dist
def test_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, capsys):
    """Rank 1 dies while writing the checkpoint of step 4: step 2 stays the latest complete
    one, and `fxpar run --resume` continues from it as one process would."""
    from tests.harness.checkpoint_faults import killed_mid_save_worker
    from planner.cli import main
    root = str(tmp_path)
    chosen = fixed(CLI_CONFIG, dp=1, tp=2, pp=2)
    with pytest.raises(RankFailure) as failure:
        run_local(killed_mid_save_worker, 4, (CLI_CONFIG, chosen.dumps(), 4, root, 2, 1, 4),
                  timeout_s=12)
    assert failure.value.summary.startswith("rank 1 died: killed by SIGKILL"), \
        failure.value.summary
    partial = checkpoint.step_dir(root, 4) + ".partial"
    assert os.path.isdir(partial) and not checkpoint.is_complete(partial)
    assert checkpoint.latest(root) == checkpoint.step_dir(root, 2)
    with pytest.raises(checkpoint.CheckpointError, match="incomplete checkpoint"):
        checkpoint.resolve(partial)
    assert main(["run", *CLI_MESH, "--steps", "4", "--checkpoint", root, "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"from the checkpoint of step 2 in {root}" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["3"], ["4"])]
    reference = reference_steps(CLI_CONFIG, 4)
    assert [int(r[0]) for r in rows] == [3, 4]
    torch.testing.assert_close(torch.tensor([float(r[1]) for r in rows]),
                               torch.tensor(reference.losses[2:]), rtol=1e-5, atol=0)
    assert all(float(r[3]) < 1e-5 for r in rows)


@pytest.mark.dist
def test_export_loads_in_transformers_with_the_same_loss(pool4, tmp_path):
    """A Hugging Face GPT-2 trained 2 steps under tp=2 x pp=2 and saved; `fxpar export` writes
    one safetensors file that from_pretrained loads: the trained weights, the same loss."""
    transformers = pytest.importorskip("transformers")
    from planner.cli import main
    from planner.models.hf import HFCausalLM
    from planner.training.resume import batch_at
    from planner.training.local import HFSpec, build
    spec = HFSpec("gpt2", global_batch=8, overrides=(("n_layer", 2),))
    torch.manual_seed(0)
    model, batch = build(spec)
    chosen = plan(model, 4, batch, cluster="cpu-gloo",
                  fix={"dp": 1, "tp": 2, "pp": 2, "mb": 1, "strategy": "tp"})[0]
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf" / "model.safetensors")
    run = run_with_checkpoints(spec, chosen, 2, root, save_every=2, pool=pool4)
    assert main(["export", "--checkpoint", root, "--out", out]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    exported = dict(loaded.named_parameters())
    for name, value in run.state.items():
        assert torch.equal(exported[name.removeprefix("model.")], value), name
    reference = reference_steps(spec, 2)
    model.load_state_dict(reference.state, strict=False)
    tokens = batch_at(batch, model.model.config.vocab_size, 16)
    with torch.no_grad():
        want, got = model(*tokens), HFCausalLM(loaded)(*tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.dist
def test_zero3_checkpoint_resumes_under_another_mesh(saved_8, tmp_path):
    """Saved under ZeRO-3 (parameters and optimizer states as flat ranges of tp shards), resumed
    with whole tensors on 4 ranks: the continuation of one process."""
    from conftest import rank_pool
    _, reference = saved_8
    root = str(tmp_path)
    saved = run_with_checkpoints(CONFIG, fixed(CONFIG, dp=2, tp=2, pp=2, zero=3), SAVED_AT,
                                 root, save_every=SAVED_AT, pool=rank_pool(8))
    assert saved.zero == 3
    resumed = run_with_checkpoints(CONFIG, fixed(CONFIG, dp=1, tp=2, pp=2), STEPS, root,
                                   resume=True, pool=rank_pool(4))
    torch.testing.assert_close(torch.tensor(resumed.losses),
                               torch.tensor(reference.losses[SAVED_AT:]), rtol=1e-5, atol=0)
    assert_same(resumed.state, reference.state, rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_loading_into_another_model_names_the_parameter(saved_8):
    """A checkpoint of a vocabulary of 250 loaded into a model of 256: refused on every rank with
    the parameter and both shapes, before anything is read."""
    from conftest import rank_pool
    root, _ = saved_8
    other = CONFIG.with_(vocab=256)
    with pytest.raises(RankFailure, match=r"parameter wte\.weight: checkpoint .* holds shape "
                                          r"\(250, 64\), the model \(256, 64\)"):
        run_with_checkpoints(other, fixed(other, dp=2, tp=1, pp=2), STEPS, root, resume=True,
                             pool=rank_pool(4))


class _WithUnusedModule(torch.nn.Module):
    """Blocks between an embedding and a head, and a `pooler` forward never reads."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
                                    for _ in range(2))
        self.pooler = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _save_and_reload_unread(root: str) -> bool:
    from planner.api import autoparallelize
    torch.manual_seed(0)
    model = _WithUnusedModule()
    batch = (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))
    pm = autoparallelize(model, 2, batch, cluster="cpu-gloo", fix={"pp": 2, "mb": 1})
    pm.train_step(*batch)
    pm.save(root)
    saved = model.pooler.weight.detach().clone()
    with torch.no_grad():
        model.pooler.weight.fill_(3.0)
    pm.load(root)
    return torch.equal(model.pooler.weight, saved)


@pytest.mark.dist
def test_a_parameter_no_stage_reads_is_saved_exported_and_restored(pool2, tmp_path):
    """A module forward never uses is in no stage program; the checkpoint still holds it (from
    the model), a resume gives it back and the export writes it: the user's whole model."""
    from planner.cli import main
    from safetensors.torch import load_file
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out" / "model.safetensors")
    assert pool2.run(_save_and_reload_unread, root) == [True, True]
    assert main(["export", "--checkpoint", root, "--out", out]) == 0
    assert set(load_file(out)) == set(_WithUnusedModule().state_dict())
