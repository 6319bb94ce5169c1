"""`fxpar train CONFIG.toml`: check everything that can be checked before a rank starts (the
config, the model, the token files, a plan for the launch's devices), then start the ranks on
this machine with torchrun's own engine (torch.distributed.run: the elastic agent, c10d
rendezvous, restarts) running planner.training.worker — gloo on CPUs, NCCL on GPUs.

On several machines the same worker runs under torchrun itself, one agent per node:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id RUN --max-restarts 3 -m planner.training.worker CONFIG.toml

With `--nnodes 1:2` the job goes on when a node is lost: the remaining agent restarts its
workers, which plan again for the devices left and resume resharded from the latest checkpoint.
"""
from __future__ import annotations

import logging
import os

from planner.training.config import TrainConfig
from planner.training.train import CHECKED_ENV, cluster_name, make_plan

WORKER = "planner.training.worker"


class LaunchError(RuntimeError):
    """The ranks failed (after any restarts); the message is one line naming the first one."""


def local_ranks(config: TrainConfig) -> int:
    n = config.parallel.nproc_per_node
    if n != "auto":
        return n
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def preflight(config: TrainConfig, world: int, log=print):
    """Everything checked before a rank starts: the model, the token files (sizes, checksums,
    largest id against the model's vocabulary) and a plan for `world` devices. Returns the
    plan; raises a one-line error."""
    import torch

    from planner.training.data import open_data
    from planner.training.model_spec import model_spec
    spec = model_spec(config)
    data = open_data(config.data.path, verify=config.data.verify)
    data.check_fits(spec.vocab, spec.seq, config.training.global_batch)
    _check_resume(config)
    cluster = cluster_name(config, torch.cuda.is_available())
    from planner.training.model_spec import parameter_count
    model = spec.meta_model()
    plan = make_plan(spec, model, world, config, cluster)
    s = data.splits
    log(f"fxpar train: {spec.name} ({spec.kind}, {parameter_count(model)}), {world} ranks "
        f"({cluster}); data "
        f"{config.data.path}: {s['train'].tokens:,} training and {s['val'].tokens:,} "
        f"validation tokens{', checksums ok' if config.data.verify else ''}")
    return plan


def _check_resume(config: TrainConfig) -> None:
    """A checkpoint to resume from that is already past the last step is an error here, not
    on every rank after the start (and again after every restart)."""
    from runtime.checkpoint import state as checkpoint
    from planner.training.train import TrainError, resume_path
    path = resume_path(config)
    if path is None:
        return
    step = checkpoint.read_marker(path)["step"]
    if step > config.training.steps:
        raise TrainError(f"the checkpoint {path} is at step {step}, past [training] steps "
                         f"{config.training.steps}: ask for more steps, or start afresh with "
                         f"--checkpoint.resume never (or another checkpoint.dir)")


class _Restarts(logging.Filter):
    """Let the elastic agent's restart decisions through (its INFO lines) and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "attempts left" in record.getMessage() or record.levelno >= logging.WARNING


def _show_restarts() -> None:
    log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    log.setLevel(logging.INFO)
    if not any(isinstance(f, _Restarts) for f in log.filters):
        log.addFilter(_Restarts())


def torchrun_args(config_path: str, overrides: list[str], nproc: int, max_restarts: int
                  ) -> list[str]:
    return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
            "-m", WORKER, config_path, *overrides]


def launch(config_path: str, overrides: list[str], config: TrainConfig, check: bool = False,
           log=print) -> int:
    """Check, then train on this machine's ranks under torchrun's engine."""
    import torch
    nproc = local_ranks(config)
    if nproc < 1:
        raise ValueError("[parallel] nproc_per_node: no GPU here; give a number of CPU ranks")
    plan = preflight(config, nproc, log)
    if check:
        log(str(plan))
        log("checked; not training (--check)")
        return 0
    os.environ[CHECKED_ENV] = "1"   # the workers need not read the files through again
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    _show_restarts()
    args = torchrun.parse_args(torchrun_args(config_path, overrides, nproc,
                                             config.parallel.max_restarts))
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        raise LaunchError(failure_line(err, config.parallel.max_restarts)) from None
    except SignalException:  # Ctrl-C or SIGTERM: the agent has ended the ranks
        raise KeyboardInterrupt from None
    return 0


_COLLATERAL = ("PeerError", "DistBackendError", "gloo", "nccl", "connection closed by peer",
               "connection reset by peer", "broken pipe")


def _message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = str(message.get("message", ""))
    return "" if not isinstance(message, str) or "<N/A>" in message else " ".join(message.split())


def _cause_order(item):
    """The cause first: a rank killed by a signal the agent does not send (SIGKILL from
    outside, SIGSEGV, the OOM killer), then one whose error is its own (not a peer's death
    seen through a collective), then the earliest."""
    rank, failure = item
    killed = failure.exitcode < 0 and failure.signal_name() not in ("SIGTERM", "SIGINT")
    text = _message(failure).lower()
    own = bool(text) and not any(c.lower() in text for c in _COLLATERAL)
    return (0 if killed else 1 if own else 2, failure.timestamp, rank)


def failure_line(err, max_restarts: int) -> str:
    """The failed rank that caused a ChildFailedError, how it ended and its error's first
    words; the other failed ranks counted."""
    rank, failure = min(err.failures.items(), key=_cause_order)
    how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"exit status {failure.exitcode}")
    message = "" if failure.exitcode < 0 else " ".join(_message(failure).split()[:60])
    after = f" after {max_restarts} restarts" if max_restarts else ""
    others = len(err.failures) - 1
    return (f"training failed{after}: rank {rank} {how}" + (f": {message}" if message else "")
            + (f" ({others} other rank{'s' if others > 1 else ''} failed with it)" if others
               else "") + (f"; its error: {failure.error_file}"
                           if message and os.path.isfile(str(failure.error_file)) else ""))
