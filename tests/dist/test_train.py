"""`fxpar train` on real gloo ranks: evaluation changes nothing, a resume under the same plan
continues bit for bit and under another plan as one process would (rtol 1e-5), and a rank
SIGKILLed mid-run under fxpar's launcher (torchrun's engine, --max-restarts) is restarted and
the job continues from the latest checkpoint on exactly the losses it had."""
import os
import pathlib
import subprocess
import sys

import pytest

from tests.harness.train_faults import kill_rank, step_losses, train_on_pool, wait_for_step

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """The project's own docs and Python files, byte-level: real text, small."""
    from planner.training.prepare import prepare
    out = tmp_path_factory.mktemp("tokens")
    prepare([str(ROOT / "docs"), str(ROOT / "planner")], str(out), val_fraction=0.05,
            log=lambda *_: None)
    return str(out)


def values(tokens, folder, steps=4, plan="auto", **sections):
    v = {"model": {"preset": "llama-tiny", "layers": 2},
         "data": {"path": tokens},
         "optimizer": {"lr": 3e-3},
         "lr_schedule": {"warmup_steps": 2, "decay_steps": 6},
         "training": {"steps": steps, "global_batch": 4, "seq": 16},
         "parallel": {"plan": plan},
         "checkpoint": {"dir": str(folder / "ckpt")},
         "logging": {"dir": str(folder), "every": 1, "plot": False},
         "eval": {"every": 0, "at_end": False, "steps": 2}}
    for name, keys in sections.items():
        v[name] = {**v[name], **keys}
    return v


@pytest.mark.dist
def test_evaluation_changes_nothing(pool2, tokens, tmp_path):
    """Losses with a validation pass after every step (forward only, through a two-stage
    pipeline) equal those without, bit for bit."""
    plain = pool2.run(
        train_on_pool, values(tokens, tmp_path / "a", plan="pp=2,dp=1"))[0]
    evaluated = pool2.run(train_on_pool, values(tokens, tmp_path / "b", plan="pp=2,dp=1",
                                                eval={"every": 1, "at_end": True}))
    assert evaluated[0]["losses"] == plain["losses"]
    assert evaluated[0]["val_loss"] == evaluated[1]["val_loss"] > 0   # the same on every rank
    from planner.training.metrics import read_metrics
    evals = [r for r in read_metrics(str(tmp_path / "b" / "metrics.jsonl"))
             if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [1, 2, 3, 4]


@pytest.mark.dist
def test_evaluation_under_zero_3_changes_nothing(pool2, tokens, tmp_path):
    """Under ZeRO-3 (each unit gathered for its forward, freed after) the losses with a
    validation pass after every step equal those without, and the validation loss is zero 0's."""
    def run(folder, zero, every):
        return pool2.run(train_on_pool, values(tokens, tmp_path / folder, plan=f"dp=2,zero={zero}",
                                               eval={"every": every, "at_end": True}))[0]
    plain, evaluated, whole = run("a", 3, 0), run("b", 3, 1), run("c", 0, 1)
    assert evaluated["losses"] == plain["losses"]
    assert evaluated["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5, abs=0)


@pytest.mark.dist
def test_resume_continues_bit_for_bit_or_resharded(pool2, tokens, tmp_path):
    """6 steps under dp=2 saving at step 3; from that checkpoint under the same plan steps 4-6
    are the same floats, under pp=2 (other stage programs, no data parallelism) equal to rtol
    1e-5, and the log says it re-planned."""
    whole = pool2.run(train_on_pool, values(tokens, tmp_path / "a", steps=6, plan="dp=2",
                                            checkpoint={"every": 3}))[0]
    saved = str(tmp_path / "a" / "ckpt" / "step-00000003")
    same = pool2.run(train_on_pool, values(tokens, tmp_path / "b", steps=6, plan="dp=2",
                                           checkpoint={"resume": saved}))[0]
    assert same["first_step"] == 3
    assert same["losses"] == {s: whole["losses"][s] for s in (4, 5, 6)}
    other = pool2.run(train_on_pool, values(tokens, tmp_path / "c", steps=6, plan="pp=2,dp=1",
                                            checkpoint={"resume": saved}))[0]
    for step in (4, 5, 6):
        assert other["losses"][step] == pytest.approx(whole["losses"][step], rel=1e-5, abs=0)
    from planner.training.metrics import read_metrics
    start = read_metrics(str(tmp_path / "c" / "metrics.jsonl"))[0]
    assert start["replanned"] and start["old_plan"].startswith("dp=2 tp=1 pp=1")
    assert start["plan"].startswith("dp=1 tp=1 pp=2")


@pytest.mark.dist
def test_weight_decay_under_zero_spares_what_zero_0_spares(pool2, tokens, tmp_path):
    """With a decay strong enough to move every loss, sharded data parallel (flat shards that
    mix norms, embeddings and weight matrices) trains to zero 0's losses: the shards' decay is
    masked to the weight matrices, as zero 0's parameter groups are."""
    def losses(zero):
        v = values(tokens, tmp_path / f"z{zero}", plan=f"dp=2,zero={zero}",
                   optimizer={"lr": 3e-3, "weight_decay": 30.0})
        return pool2.run(train_on_pool, v)[0]["losses"]
    plain = losses(0)
    for zero in (1, 3):
        assert losses(zero) == pytest.approx(plain, rel=1e-5, abs=0), f"zero={zero}"


def _write_config(path, v: dict) -> None:
    def value(x):
        if isinstance(x, bool):
            return "true" if x else "false"
        if isinstance(x, str):
            return f'"{x}"'
        return repr(x)
    lines = []
    for section, keys in v.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(x)}" for k, x in keys.items()]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.dist
def test_a_killed_rank_restarts_the_job_from_the_last_checkpoint(tokens, tmp_path):
    """fxpar train on 2 ranks, --max-restarts 1: rank 1 SIGKILLed after step 5 (checkpoint at
    4); the agent restarts both ranks, which resume from step 4 under the same plan and train
    steps 5.. to the same losses bit for bit, and finish."""
    v = values(tokens, tmp_path / "run", steps=8, plan="dp=2", checkpoint={"every": 4})
    config = tmp_path / "run.toml"
    _write_config(config, v)
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "train", str(config),
                             "--nproc-per-node", "2", "--max-restarts", "1"],
                            cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(metrics, 5, proc, timeout_s=240)
        kill_rank(proc.pid, 1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    losses = step_losses(metrics)
    assert sorted(losses) == [0, 1]
    assert min(losses[1]) == 5 and max(losses[1]) == 8
    repeated = [s for s in losses[0] if s >= 5]
    assert repeated and all(losses[1][s] == losses[0][s] for s in repeated)
    assert "resumed from step 4" in out and "under the same plan" in out


@pytest.mark.dist
def test_a_lost_node_re_plans_for_the_devices_left(tokens, tmp_path):
    """Two "nodes" on localhost: two torchrun agents of one rank each, --nnodes 1:2, c10d
    rendezvous. The second node is killed (agent and worker) after step 5; the first agent
    restarts its worker alone, which plans for 1 device, resumes resharded from the checkpoint
    of step 4 and finishes, with the losses of the steps trained twice equal to rtol 1e-5."""
    from runtime.launch.ranks import free_port
    from tests.harness.train_faults import kill_node
    port = free_port()
    v = values(tokens, tmp_path / "run", steps=8, checkpoint={"every": 4})
    config = tmp_path / "run.toml"
    _write_config(config, v)
    metrics = str(tmp_path / "run" / "metrics.jsonl")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--max-restarts", "1",
                "--rdzv-conf", "last_call_timeout=10", "-m", "planner.training.worker",
                str(config)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    nodes = []
    try:
        # The first node hosts the rendezvous store (c10d: the endpoint's host must survive),
        # so the second starts once the first listens.
        for log in logs:
            nodes.append(subprocess.Popen(torchrun, cwd=str(ROOT), env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
            if len(nodes) == 1:
                _wait_for_port(port, nodes[0])
        both = _attempt_of_world(metrics, 2, nodes[0])  # a slow second node may join late
        wait_for_step(metrics, 5, nodes[0], timeout_s=240, attempt=both)
        kill_node(nodes[1].pid)
        nodes[0].wait(timeout=300)
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node.pid)
        for log in logs:
            log.close()
    out = (tmp_path / "node0.log").read_text()
    assert nodes[0].returncode == 0, out[-3000:]
    from planner.training.metrics import read_metrics
    starts = [r for r in read_metrics(metrics) if r["kind"] == "start"]
    assert [s["world_size"] for s in starts][-2:] == [2, 1]
    assert starts[-1]["replanned"] and starts[-1]["old_world_size"] == 2
    assert starts[-1]["resumed_from"] == 4
    losses = step_losses(metrics)
    before, after = losses[starts[-2]["attempt"]], losses[starts[-1]["attempt"]]
    assert max(after) == 8
    for step in set(before) & set(after):
        assert after[step] == pytest.approx(before[step], rel=1e-5, abs=0)


def _wait_for_port(port: int, proc, timeout_s: float = 120) -> None:
    import socket
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


def _attempt_of_world(metrics: str, world: int, proc, timeout_s: float = 240) -> int:
    """The elastic attempt that started with `world` ranks (waits for it)."""
    import time

    from planner.training.metrics import read_metrics
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for r in read_metrics(metrics):
            if r["kind"] == "start" and r["world_size"] == world:
                return r["attempt"]
        time.sleep(0.1)
    raise TimeoutError(f"no start with {world} ranks in {metrics}")
