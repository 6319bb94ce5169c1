"""Activation memory under context parallel: bytes saved for backward per rank at a long sequence.

    python examples/bench_cp_memory.py [--seq 4096] [--cp 1 2 4 8]

A one-block GPT with a tiny hidden size (so attention dominates) is captured, rewritten by
`passes.rewrite.context_parallel` for cp ranks and run forward on each rank's zig-zag share of the tokens,
in real gloo process groups. A saved-tensors hook adds up the storage autograd keeps for backward
(parameters and buffers excluded). Both attention forms are measured:

  math  softmax(q kᵀ) v written out: one process keeps s x s scores per head. The ring never holds
        more than one block of (s / 2cp)² scores per head at a time (cp² times smaller per step,
        4cp² with zig-zag chunk pairs) and saves none: backward recomputes them per block.
  sdpa  the fused kernel saves O(s) per head; under context parallel every activation is cut by cp.
"""
from __future__ import annotations

import argparse
import os
import sys

# Run from a source checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402

MiB = 2**20


def _config(form: str, seq: int):
    from planner.models.presets import ModelConfig
    return ModelConfig("gpt", layers=1, hidden=32, heads=2, vocab=256, seq=seq, attention=form,
                       name="gpt-cp-bench")


def measure(form: str, seq: int) -> dict:
    """Saved-for-backward bytes of this rank's forward (one process: cp = 1)."""
    from passes.capture.trace import capture
    from passes.rewrite.context_parallel import context_parallel
    from planner.models.presets import build_model, example_batch
    from runtime.comm import collectives
    from runtime.programs.token_split import shard_sequence

    cp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = _config(form, seq)
    torch.manual_seed(0)
    model = build_model(config)
    batch = example_batch(config, 1)
    captured = capture(model, batch)
    gm = context_parallel(captured.gm, {l.name: l.nodes for l in captured.blocks}, cp, rank)
    collectives.bind_groups(cp=dist.group.WORLD if cp > 1 else None)
    fixed = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in fixed:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gm(*[shard_sequence(t, cp, rank) for t in batch])
    loss.backward()
    collectives.bind_groups(cp=None)
    return {"saved": sum(saved.values()), "largest": max(saved.values())}


def _run(form: str, seq: int, cp: int) -> dict:
    if cp == 1:
        return measure(form, seq)
    from runtime.launch.ranks import run_local
    return run_local(measure, cp, (form, seq), timeout_s=600)[0]


def score_block(form: str, seq: int, cp: int, heads: int = 2) -> int:
    """fp32 bytes of the largest score block computed at once (batch 1)."""
    if cp == 1:
        return heads * seq * seq * 4 if form == "math" else 0
    side = seq // (2 * cp)  # the ring attends zig-zag chunk pairs
    return heads * side * side * 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    rows = []
    for form in ("math", "sdpa"):
        base = None
        for cp in args.cp:
            print(f"measuring {form} at cp={cp} ...", file=sys.stderr, flush=True)
            got = _run(form, args.seq, cp)
            base = base or got["saved"]
            block = score_block(form, args.seq, cp)
            rows.append([form, cp, args.seq // cp, f"{got['saved'] / MiB:.2f}",
                         f"{got['largest'] / MiB:.3f}", f"{block / MiB:.3f}" if block else "-",
                         f"{base / got['saved']:.1f}x"])
    print(tabulate(rows, headers=["form", "cp", "tokens/rank", "saved/rank MiB",
                                  "largest saved MiB", "score block MiB", "saved vs cp=1"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
