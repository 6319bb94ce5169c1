"""Checkpoint options and folders that cannot work are one-line errors before any rank starts."""
import json
import os

from planner.cli import main
from runtime.checkpoint import state as checkpoint

RUN = ["run", "--model", "gpt-tiny", "--layers", "2", "--global-batch", "8", "--gpus", "2",
       "--fix", "dp=1,tp=1,pp=2,mb=1"]


def error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def complete(folder, step: int) -> str:
    path = checkpoint.step_dir(str(folder), step)
    os.makedirs(path)
    with open(os.path.join(path, checkpoint.MARKER), "w") as f:
        json.dump({"step": step}, f)
    return path


def test_save_every_and_resume_need_a_checkpoint_folder(capsys):
    assert "--save-every needs --checkpoint DIR" in error(capsys, RUN + ["--save-every", "2"])
    assert "--resume needs --checkpoint DIR" in error(capsys, RUN + ["--resume"])


def test_resume_from_a_folder_without_a_complete_checkpoint(capsys, tmp_path):
    os.makedirs(checkpoint.step_dir(str(tmp_path), 2) + ".partial")
    err = error(capsys, RUN + ["--checkpoint", str(tmp_path), "--resume"])
    assert f"{tmp_path} holds no complete checkpoint" in err


def test_resume_past_the_requested_steps(capsys, tmp_path):
    complete(tmp_path, 4)
    err = error(capsys, RUN + ["--checkpoint", str(tmp_path), "--resume", "--steps", "4"])
    assert "is at step 4, which --steps 4 does not pass" in err


def test_latest_skips_partial_and_unmarked_folders(tmp_path):
    complete(tmp_path, 2)
    os.makedirs(checkpoint.step_dir(str(tmp_path), 6) + ".partial")
    os.makedirs(checkpoint.step_dir(str(tmp_path), 8))          # no marker: not finished
    assert checkpoint.latest(str(tmp_path)) == checkpoint.step_dir(str(tmp_path), 2)
    assert checkpoint.resolve(str(tmp_path)) == checkpoint.step_dir(str(tmp_path), 2)
    assert checkpoint.latest(str(tmp_path / "absent")) is None


def test_export_refuses_other_file_kinds_and_empty_folders(capsys, tmp_path):
    err = error(capsys, ["export", "--checkpoint", str(tmp_path), "--out", "x.bin"])
    assert "give a file name ending in .safetensors" in err
    err = error(capsys, ["export", "--checkpoint", str(tmp_path), "--out", "x.safetensors"])
    assert "holds no complete checkpoint" in err


def test_checkpoints_are_not_for_torchrun_commands(capsys, tmp_path):
    err = error(capsys, RUN + ["--checkpoint", str(tmp_path), "--torchrun", str(tmp_path)])
    assert "under torchrun call pm.save(DIR) / pm.load(DIR)" in err
