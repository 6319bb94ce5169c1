"""What `fxpar train` reports, on rank 0: a line every [logging] every steps, a progress bar on a
terminal, every step and evaluation as a JSON line in <logging.dir>/metrics.jsonl (appended
across restarts, each line with its attempt), TensorBoard scalars when it is installed, and the
loss curve as loss.png at the end.

The log line:

    step 200/300  loss 1.8734  lr 6.91e-04  grad norm 0.412  5,120 tokens/s  0.061 TFLOP/s per
    device  MFU 0.06%  peak memory 0.52 GiB

Model FLOPs of a step are the plan's (the cost model's forward and backward of the global
batch, without recomputation); TFLOP/s per device divides them by the step's time and the
devices, MFU by the cluster's peak FLOP/s per device as well.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch

from runtime.launch.progress import Progress


def step_flops(plan) -> float:
    """Model FLOPs of one training step of the plan (forward + backward, global batch)."""
    p = plan.predicted
    return p.tflops_per_gpu * 1e12 * p.iteration_s * plan.gpus


def peak_memory_bytes() -> float:
    """This process's peak: CUDA memory allocated on a GPU, else its peak resident set."""
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss * (1 if sys.platform == "darwin" else 1024))


def plan_summary(plan) -> str:
    """'dp=2 tp=1 pp=2 cp=1, 1f1b x4 micro-batches of 2' (one line, for logs)."""
    extra = f" zero={plan.zero}" if plan.zero else ""
    extra += f" ep={plan.ep}" if plan.ep > 1 else ""
    return (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp}{extra}, {plan.schedule} "
            f"x{plan.num_microbatches} micro-batches of {plan.micro_batch}")


class Metrics:
    """Rank 0's reports (`enabled` False on the other ranks: everything is a no-op)."""

    def __init__(self, folder: str, steps: int, every: int, plan, peak_flops: float, *,
                 enabled: bool = True, attempt: int = 0, progress="auto", tensorboard="auto",
                 first_step: int = 0, stream=None, log=print):
        self.enabled, self.every, self.steps, self.attempt = enabled, every, steps, attempt
        self.flops, self.peak_flops, self.devices = step_flops(plan), peak_flops, plan.gpus
        self.tokens = plan.global_batch * plan.seq
        self.log = log
        self.path = os.path.join(folder, "metrics.jsonl")
        self._file = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        os.makedirs(folder, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        stream = stream or sys.stderr
        tty = stream.isatty() if progress == "auto" else bool(progress)
        if tty:
            self._bar = Progress(steps - first_step, stream=stream, tty=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                # an earlier attempt's steps from first_step + 1 on are hidden: the latest wins
                self._tb = SummaryWriter(os.path.join(folder, "tensorboard"),
                                         purge_step=first_step + 1)
            except ImportError:
                if tensorboard is True:
                    raise
        self._window: list[float] = []   # step times since the last line

    def record(self, kind: str, **fields) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"kind": kind, "attempt": self.attempt, **fields},
                                    separators=(",", ":")) + "\n")

    def flush(self) -> None:
        """To the operating system (a rank killed later loses nothing written before)."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def rates(self, seconds: float) -> dict:
        tflops = self.flops / seconds / self.devices / 1e12
        return {"tokens_per_s": self.tokens / seconds, "tflops_per_device": tflops,
                "mfu": tflops * 1e12 / self.peak_flops}

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None, seconds: float,
             peak_memory: float | None = None) -> str | None:
        """Record a training step; returns (and prints) the log line on a logging step."""
        if not self.enabled:
            return None
        self._window.append(seconds)
        rates = self.rates(seconds)
        self.record("train", step=step, loss=loss, lr=lr, grad_norm=grad_norm, step_s=seconds,
                    **rates, **({"peak_memory_gib": peak_memory / 2**30}
                                if peak_memory is not None else {}))
        self._file.flush()
        if self._tb is not None:
            for name, value in (("train/loss", loss), ("train/lr", lr),
                                ("train/grad_norm", grad_norm),
                                ("perf/tokens_per_s", rates["tokens_per_s"])):
                if value is not None:
                    self._tb.add_scalar(name, value, step)
        line = None
        if step % self.every == 0 or step == self.steps:
            mean = sum(self._window) / len(self._window)   # the steps since the last line
            self._window = []
            line = self.line(step, loss, lr, grad_norm, mean, peak_memory)
            if self._bar is not None:
                self._bar.stream.write("\r" + " " * self._bar._drawn + "\r")
            self.log(line)
            self.flush()
        if self._bar is not None:
            self._bar.update(advance=1, per_s=rates["tokens_per_s"], loss=loss)
        return line

    def line(self, step, loss, lr, grad_norm, seconds, peak_memory) -> str:
        r = self.rates(seconds)
        parts = [f"step {step}/{self.steps}", f"loss {loss:.4f}", f"lr {lr:.3g}"]
        if grad_norm is not None:
            parts.append(f"grad norm {grad_norm:.3f}")
        parts += [f"{r['tokens_per_s']:,.0f} tokens/s",
                  f"{r['tflops_per_device']:.3g} TFLOP/s per device",
                  f"MFU {100 * r['mfu']:.2f}%"]
        if peak_memory is not None:
            parts.append(f"peak memory {peak_memory / 2**30:.2f} GiB")
        return "  ".join(parts)

    def eval(self, step: int, loss: float, seconds: float, batches: int) -> None:
        if not self.enabled:
            return
        self.record("eval", step=step, val_loss=loss, eval_s=seconds, batches=batches)
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", loss, step)
        self.log(f"eval at step {step}: validation loss {loss:.4f} over {batches} batches "
                 f"({seconds:.1f} s)")
        self.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (a line cut short by a kill is skipped)."""
    records = []
    if not os.path.exists(path):
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def curves(records: list[dict]) -> tuple[dict[int, float], dict[int, float], list[dict]]:
    """(train loss by step, validation loss by step, start records): for a step trained more
    than once (before a kill, then after the restart) the latest attempt's value."""
    train, val, starts = {}, {}, []
    for r in records:
        if r.get("kind") == "train":
            train[r["step"]] = r["loss"]
        elif r.get("kind") == "eval":
            val[r["step"]] = r["val_loss"]
        elif r.get("kind") == "start":
            starts.append(r)
    return train, val, starts


def plot_losses(path: str, out: str, title: str = "", entropy: float | None = None) -> str:
    """The loss curve of a metrics.jsonl as a PNG: training loss per step, validation loss,
    restarts as dashed lines (with the plan each one resumed under), the data's unigram
    entropy as a dotted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    train, val, starts = curves(read_metrics(path))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if train:
        steps = sorted(train)
        ax.plot(steps, [train[s] for s in steps], lw=0.8, color="tab:blue", label="training loss")
    if val:
        steps = sorted(val)
        ax.plot(steps, [val[s] for s in steps], "o-", ms=4, color="tab:orange",
                label="validation loss")
    if entropy is not None and math.isfinite(entropy):
        ax.axhline(entropy, ls=":", color="gray", label=f"unigram entropy {entropy:.3f}")
    for s in starts:
        if s.get("resumed_from"):
            ax.axvline(s["resumed_from"], ls="--", lw=0.8, color="tab:red")
            ax.annotate(f"resumed on {s.get('world_size')} ranks\n{s.get('plan', '')}",
                        (s["resumed_from"], ax.get_ylim()[1]),
                        fontsize=6, va="top", ha="left", color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


class Clock:
    """Seconds spent per part of the loop (data, schedule, step, logging, ...)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, part: str) -> float:
        now = time.perf_counter()
        took = now - self._last
        self.totals[part] = self.totals.get(part, 0.0) + took
        self._last = now
        return took
