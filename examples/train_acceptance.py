"""`fxpar train`'s acceptance run, on this machine's CPUs (about 10-15 minutes on two cores):

1. `fxpar data prepare` tokenizes the Python standard library's .py/.rst/.txt files (the
   interpreter's own, real text) byte-level into uint16 token files with a validation split.
2. `fxpar train` trains a Llama-style model of about 10.5 M parameters on 4 gloo ranks under
   [parallel] plan = "auto" for 300 steps (AdamW, warm-up then cosine), saving a checkpoint
   every 50 steps, evaluating every 100, under torchrun's engine with --max-restarts 2.
3. Mid-run (after step 130) rank 2 is SIGKILLed. The agent restarts the 4 ranks, which resume
   from the checkpoint of step 100 under the same plan; the steps trained twice must have the
   same losses bit for bit.
4. From that same checkpoint, `fxpar train --nproc-per-node 2` continues on 2 ranks: a new plan,
   whose losses over the next 20 steps must equal the 4-rank run's within rtol 1e-5.

It prints the figures: validation loss beside the validation split's unigram entropy, the
restart equalities, the trainer's own overhead around the step, and writes the loss curve.

    python examples/train_acceptance.py                    # into /tmp/fxpar-acceptance
    python examples/train_acceptance.py --out runs/acc --steps 200 --kill-after 80
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.train_faults import kill_rank, step_losses, wait_for_step  # noqa: E402

CONFIG = """\
[model]
preset = "llama-tiny"       # RMSNorm, rotary positions, SwiGLU, grouped-query attention
layers = 6
hidden = 384
heads = 6
kv_heads = 2
ffn = 1152
vocab = 256                 # the byte-level tokenizer

[data]
path = "{data}"

[optimizer]
name = "adamw"
lr = 2e-3
betas = [0.9, 0.95]
weight_decay = 0.1

[lr_schedule]
warmup_steps = 20
decay = "cosine"
decay_steps = {decay}       # explicit, so a continuation with fewer steps keeps the same rates
min_lr = 2e-4

[training]
steps = {steps}
global_batch = 8
seq = 128
clip_grad_norm = 1.0
seed = 0

[parallel]
plan = "auto"
nproc_per_node = 4
max_restarts = 2

[checkpoint]
every = 50

[logging]
dir = "{run}"
every = 10

[eval]
every = 100
steps = 4
"""


def fxpar(*args) -> list[str]:
    return [sys.executable, "-m", "planner.cli", *args]


def stream(proc, log, prefix: str = "") -> threading.Thread:
    """Copy a child's output to the console and a log file as it comes."""
    def copy():
        with open(log, "a") as f:
            for line in proc.stdout:
                f.write(line)
                if not line.startswith(("-------", "stage ", "0  ", "1  ", "2  ", "3  ")):
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()
    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def end_record(metrics: str) -> dict:
    with open(metrics) as f:
        ends = [json.loads(line) for line in f if '"kind":"end"' in line]
    return ends[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/fxpar-acceptance")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-after", type=int, default=130, help="kill rank 2 after this step")
    p.add_argument("--continue-steps", type=int, default=20,
                   help="steps the 2-rank continuation trains")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()

    stdlib = sysconfig.get_paths()["stdlib"]
    data = out / "stdlib-tokens"
    subprocess.run(fxpar("data", "prepare", stdlib, "--out", str(data), "--include",
                         "*.py,*.rst,*.txt", "--exclude",
                         "site-packages/*,test/*,*/test/*,*/tests/*,idlelib/*",
                         "--val-fraction", "0.02"), check=True, env=env, cwd=ROOT)
    header = json.loads((data / "header.json").read_text())
    entropy = header["splits"]["val"]["unigram_entropy"]

    run = out / "run4"
    config = out / "train.toml"
    config.write_text(CONFIG.format(data=data, run=run, steps=args.steps,
                                    decay=args.steps - 20))
    print(f"\n== fxpar train {config} (4 gloo ranks, plan auto); rank 2 is killed after step "
          f"{args.kill_after}", flush=True)
    proc = subprocess.Popen(fxpar("train", str(config)), env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    copier = stream(proc, out / "run4.log")
    metrics = str(run / "metrics.jsonl")
    wait_for_step(metrics, args.kill_after, proc, timeout_s=3600, attempt=0)
    victim = kill_rank(proc.pid, 2)
    killed_at = time.perf_counter()
    print(f"== killed rank 2 (pid {victim}) after step {args.kill_after}", flush=True)
    proc.wait()
    copier.join()
    if proc.returncode:
        print(f"fxpar train failed with status {proc.returncode}")
        return 1
    losses = step_losses(metrics)
    first, second = losses[0], losses[max(losses)]
    resumed = min(second)
    twice = sorted(set(first) & set(second))
    same = [s for s in twice if first[s] == second[s]]
    end4 = end_record(metrics)

    ckpt = run / "checkpoints" / f"step-{resumed - 1:08d}"
    run2 = out / "run2"
    upto = resumed - 1 + args.continue_steps
    print(f"\n== from {ckpt} on 2 gloo ranks, steps {resumed}-{upto}", flush=True)
    proc = subprocess.Popen(fxpar("train", str(config), "--nproc-per-node", "2",
                                  "--checkpoint.resume", str(ckpt),
                                  "--checkpoint.dir", str(run2 / "checkpoints"),
                                  "--logging.dir", str(run2), "--training.steps", str(upto),
                                  "--checkpoint.every", "0"),
                            env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    copier = stream(proc, out / "run2.log", prefix="[2 ranks] ")
    proc.wait()
    copier.join()
    if proc.returncode:
        print(f"the 2-rank continuation failed with status {proc.returncode}")
        return 1
    two = step_losses(str(run2 / "metrics.jsonl"))[0]
    rel = {s: abs(two[s] - second[s]) / abs(second[s]) for s in two}
    plans = [json.loads(line) for line in open(run2 / "metrics.jsonl")
             if '"kind":"start"' in line][0]
    end2 = end_record(str(run2 / "metrics.jsonl"))

    picture = plot(losses, two, metrics, out / "loss-curve.png", entropy, resumed - 1)
    took = time.perf_counter() - started
    print("\n== acceptance figures")
    print(f"validation loss after {args.steps} steps: {end4['val_loss']:.4f} nats per token; "
          f"unigram entropy of the validation split: {entropy:.4f} nats "
          f"({'below' if end4['val_loss'] < entropy else 'NOT below'} it by "
          f"{entropy - end4['val_loss']:.4f})")
    print(f"kill and restart: the job resumed at step {resumed} (checkpoint of step "
          f"{resumed - 1}) under the same plan; steps {twice[0]}-{twice[-1]} trained twice: "
          f"{len(same)}/{len(twice)} losses bit-identical"
          f" ({time.perf_counter() - killed_at:.0f} s from the kill to the end of the job)")
    print(f"2 ranks from the same checkpoint: plan {plans['plan']} (was {plans['old_plan']}); "
          f"steps {min(two)}-{max(two)}: largest relative loss difference "
          f"{max(rel.values()):.2e} (rtol 1e-5: {'ok' if max(rel.values()) <= 1e-5 else 'FAILED'})")
    print(f"trainer overhead around the step: {100 * end4['overhead']:.2f}% of step time "
          f"(4 ranks), {100 * end2['overhead']:.2f}% (2 ranks)")
    print(f"loss curve: {picture}; logs: {out}/run4.log, {out}/run2.log; {took / 60:.1f} min")
    ok = (end4["val_loss"] < entropy and len(same) == len(twice) > 0
          and max(rel.values()) <= 1e-5 and end4["overhead"] < 0.05)
    print("acceptance: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


def plot(losses, two, metrics, path, entropy, resumed_from) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.training.metrics import curves, read_metrics
    _, val, _ = curves(read_metrics(metrics))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = ["tab:blue", "tab:green", "tab:purple"]
    for attempt, steps in sorted(losses.items()):
        xs = sorted(steps)
        ax.plot(xs, [steps[s] for s in xs], lw=0.8, color=colors[attempt % 3],
                label=f"4 ranks, attempt {attempt}" + (" (rank 2 killed)" if attempt == 0
                                                        else " (restarted)"))
    xs = sorted(two)
    ax.plot(xs, [two[s] for s in xs], "x", ms=4, color="tab:red",
            label="2 ranks from the same checkpoint (new plan)")
    ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", color="tab:orange",
            label="validation loss")
    ax.axhline(entropy, ls=":", color="gray", label=f"unigram entropy {entropy:.3f}")
    ax.axvline(resumed_from, ls="--", lw=0.8, color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("fxpar train: Llama 10.5 M, Python stdlib bytes, 4 gloo ranks, plan auto",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
