"""Fuzz parallel training against one process: random tiny models × random fixed plans.

    python examples/fuzz.py --examples 200 --seed 0
    python examples/fuzz.py --examples 50 --seed 0 --shrink   # and minimise the first failure
    python examples/fuzz.py --replay "Case(config=ModelConfig(...), gpus=4, fix={...}, steps=2)"

Each case (tests.harness.fuzzing.build_case, drawn uniformly from a seeded generator) is planned with
its settings fixed (or, with a strategy drawn per block or vocabulary-parallel ends, priced as
given by planner.interop.configuration), trained on 4 or 8 local gloo ranks and compared with the same model
trained in one process: per-step losses, every gradient and the final parameters, rtol 1e-5. One
line per case; at the end, how many passed, how many the planner refused, how many failed, each
failure as a replayable Case. A mismatch past rtol counts as noise, not a failure, when the
parallel run is no farther from the same training in float64 than the fp32 one-process run is (a
few steps of SGD at lr 0.5 amplify summation-order differences; tests.harness.fuzzing.within_fp32_noise).
--shrink then minimises the first failure: every choice of its case, in turn, to the simplest
option that still fails the same way. Cases that fail for a known open reason
(tests.harness.fuzzing.known_failure) are counted apart.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

# the repository root, for the tests' harness (tests.harness.fuzzing)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _summary(err: BaseException, width: int = 400) -> str:
    """The error in a few lines: for a distributed run, each distinct rank error's first line."""
    lines = str(err).strip().splitlines() or [""]
    ranks = sorted({l.split(": ", 1)[1] for l in lines if l.startswith("rank ") and ": " in l})
    if ranks:
        return "\n          ".join(f"on a rank: {r[:width]}" for r in ranks)
    return f"{type(err).__name__}: " + " ".join(l.strip() for l in lines[:6])[:width]


def _kind(err: BaseException) -> str:
    """What a failure is, for shrinking to the same one: the error type (a rank's, for a
    distributed run) and, for a mismatch, which quantity differs."""
    text = _summary(err)
    if text.startswith("on a rank: "):
        return text.removeprefix("on a rank: ").split(":")[0]
    found = re.search(r"(losses|gradient|final|parameter names)", text)
    return type(err).__name__ + (f" {found.group(1)}" if found else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="cases to draw (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worlds", default="4,8", help="rank counts to draw from (default 4,8)")
    parser.add_argument("--shrink", action="store_true", help="minimise the first failure")
    parser.add_argument("--replay", metavar="CASE", help="run one Case(...) as printed")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="collective timeout of the ranks in seconds (default 60)")
    args = parser.parse_args(argv)

    from tests.harness.fuzzing import (Case, Chooser, Refused, build_case, describe, known_failure,
                                 plan_case, shrink, train_both, within_fp32_noise)
    from planner.models.presets import ModelConfig
    from planner.training.local import assert_same_run
    from runtime.launch.ranks import RankPool

    worlds = tuple(int(w) for w in args.worlds.split(","))
    pools: dict[int, RankPool] = {}
    refusals: dict[str, int] = {}
    passed, refused, noisy, failed, known = 0, 0, [], [], []

    def pool(n: int) -> RankPool:
        if n not in pools or not pools[n].alive:  # a rank died or hung: start fresh ranks
            pools[n] = RankPool(n, timeout_s=args.timeout)
        return pools[n]

    def run(case: Case) -> tuple[str, object]:
        """("pass", plan text) | ("refused", reason) | ("noise" or "fail", (plan text, error)):
        a mismatch is noise when a float64 run shows the fp32 one-process run as far off."""
        try:
            chosen = plan_case(case)
        except Refused as err:
            return "refused", str(err)
        except Exception as err:  # noqa: BLE001 - a planner crash or a plan that ignores the fix
            return "fail", ("-", err)
        try:
            parallel, reference = train_both(case, chosen, pool(case.gpus))
            assert_same_run(parallel, reference, rtol=1e-5, what=case.line())
        except AssertionError as err:
            noise = within_fp32_noise(case, parallel, reference)
            return "noise" if noise else "fail", (describe(chosen), err)
        except Exception as err:  # noqa: BLE001 - every failure is reported, then counted
            return "fail", (describe(chosen), err)
        return "pass", describe(chosen)

    started = time.perf_counter()
    try:
        if args.replay:
            todo = [(eval(args.replay, {"Case": Case, "ModelConfig": ModelConfig}), None)]
        else:
            rng = random.Random(args.seed)
            todo = []
            for _ in range(args.examples):
                chooser = Chooser(rng)
                todo.append((build_case(chooser, worlds), chooser.made))
        for i, (case, indices) in enumerate(todo, 1):
            start = time.perf_counter()
            outcome, detail = run(case)
            head = f"[{i:3d}/{len(todo)}]"
            if outcome == "refused":
                refused += 1
                why = re.sub(r"\d+", "#", detail.removeprefix("PlanningError: "))[:110]
                refusals[why] = refusals.get(why, 0) + 1
                print(f"{head} refused {case.line()}\n          {detail[:200]}", flush=True)
            elif outcome == "pass":
                passed += 1
                print(f"{head} pass  {case.line()}\n          plan: {detail} "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)
            elif outcome == "noise":
                noisy.append((case, indices, detail[1]))
                print(f"{head} noise {case.line()}\n          plan: {detail[0]}\n          "
                      f"{_summary(detail[1])}\n          (no farther from float64 than the "
                      f"one-process fp32 run)", flush=True)
            else:
                plan_text, err = detail
                reason = known_failure(case)
                (known if reason else failed).append((case, indices, err))
                print(f"{head} {'KNOWN' if reason else 'FAIL '} {case.line()}\n          plan: "
                      f"{plan_text}\n          {_summary(err)}"
                      + (f"\n          ({reason})" if reason else ""), flush=True)
        print(f"\n{len(todo)} cases: {passed} passed, {refused} refused by the planner, "
              f"{len(noisy)} past rtol by fp32 noise alone, {len(failed)} failed, "
              f"{len(known)} failed for a known reason "
              f"({time.perf_counter() - started:.0f} s)")
        for why, count in sorted(refusals.items(), key=lambda kv: -kv[1]):
            print(f"  refused {count}x: {why}")
        for case, _, err in noisy:
            print(f"\nNOISE: {case.line()}\n  {_summary(err)}\n"
                  f"  replay: python examples/fuzz.py --replay {repr(case)!r}")
        for case, _, err in failed:
            print(f"\nFAILED: {case.line()}\n  {_summary(err)}\n"
                  f"  replay: python examples/fuzz.py --replay {repr(case)!r}")
        if args.shrink and failed and failed[0][1] is not None:
            case, indices, err = failed[0]
            kind = _kind(err)
            print(f"\nshrinking the first failure ({kind}) ...", flush=True)

            def same_failure(trial: Case) -> bool:
                outcome, detail = run(trial)
                return outcome == "fail" and _kind(detail[1]) == kind

            smallest = Chooser(indices=shrink(indices, same_failure, worlds))
            case = build_case(smallest, worlds)
            print(f"\nMINIMAL: {case.line()}\n"
                  f"  replay: python examples/fuzz.py --replay {repr(case)!r}")
    finally:
        for p in pools.values():
            p.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
