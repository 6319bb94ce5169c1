"""How fast a failed or interrupted run ends, and what its first line says.

    python examples/fault_times.py

Trains the tiny GPT of tests.harness.faults on 2 or 4 local gloo ranks and, in step 2, SIGKILLs one
rank at a pipeline send, a backward, the data-parallel gradient all-reduce or the optimizer step,
or makes one raise; then interrupts `fxpar run` from outside with SIGINT, SIGTERM and SIGKILL.
Prints, per scenario, the seconds from the fault to the exit of the last rank (for a signal to
the launcher: until no rank runs / until the launcher exited) and the first line of the report,
or the exit status. The same scenarios are asserted in tests/dist/test_faults.py.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

# Run from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabulate import tabulate  # noqa: E402

from tests.harness.faults import interrupt_cli, timed_fault  # noqa: E402

FAULTS = [  # (dp, pp, victim, point, fate)
    (1, 2, 0, "forward p2p", "kill"),
    (1, 2, 1, "backward", "kill"),
    (2, 2, 2, "dp all-reduce", "kill"),
    (2, 1, 1, "optimizer step", "kill"),
    (1, 2, 1, "backward", "raise"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=12,
                        help="process-group timeout of the runs, seconds")
    args = parser.parse_args()
    rows = []
    for dp, pp, victim, point, fate in FAULTS:
        with tempfile.TemporaryDirectory() as folder:
            failure, took = timed_fault(folder, dp, pp, victim, point, fate,
                                        timeout_s=args.timeout)
        rows.append([f"{'SIGKILL' if fate == 'kill' else 'raise'} at {point}",
                     f"dp={dp} pp={pp}", f"{took:.2f}", failure.summary[:90]])
        print(rows[-1], flush=True)
    if sys.platform.startswith("linux"):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            with tempfile.TemporaryDirectory() as folder:
                code, ranks_ended, exited, ranks, left = interrupt_cli(folder, sig)
            rows.append([f"{sig.name} to `fxpar run`", "dp=1 pp=2",
                         f"{ranks_ended:.2f} / {exited:.2f}",
                         f"exit status {code}, ranks left running: {len(left)} of "
                         f"{len(ranks)}"])
            print(rows[-1], flush=True)
    print(tabulate(rows, headers=["scenario", "ranks", "s to last exit", "first line"]))
    print(f"(process-group timeout {args.timeout:g} s)")


if __name__ == "__main__":
    main()
