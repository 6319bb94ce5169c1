"""What each rank of `fxpar train` runs, under torchrun or fxpar's launcher (which runs
torchrun's engine):

    torchrun --nproc-per-node 4 -m planner.training.worker CONFIG.toml [--section.key VALUE ...]

It reads the same config and overrides as `fxpar train` and trains (planner.training.train).
An error ends this rank with status 1 and one line on stderr naming the rank; torchrun's agent
then ends the other ranks and, with --max-restarts, starts them all again (they resume from the
latest complete checkpoint)."""
from __future__ import annotations

import sys


def _one_line(text: str, limit: int = 600) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    import os

    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from planner.training.config import load
    from planner.training.train import run
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m planner.training.worker CONFIG.toml [--section.key VALUE ...]",
              file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "?")
    errors = get_error_handler()  # torchrun's error file: the launcher's summary reads it
    errors.initialize()
    try:
        run(load(argv[0], argv[1:]), log=lambda line: print(line, flush=True))
    except (ValueError, RuntimeError, OSError, KeyError) as err:
        errors.record_exception(err)
        print(f"fxpar train: rank {rank}: error: {_one_line(err)}", file=sys.stderr, flush=True)
        return 1
    except BaseException as err:  # a bug: its traceback too
        if isinstance(err, Exception):
            errors.record_exception(err)
        raise
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; the launcher says so once
        sys.exit(130)
