"""The repeated blocks of a captured model as an ordered sequence of runs of identical blocks.

Blocks are identical when their graphs are (passes.capture.trace's signature: the same ops on the same
shapes, the block's own name aside). Each distinct signature is a kind, numbered in order of first
appearance; a run is a maximal stretch of consecutive blocks of one kind. A model of identical
blocks is one run of kind 0; "two dense blocks, then MoE blocks" is two runs; an alternating
pattern A B A B is four runs of two kinds. The planner prices one block per kind and the stage ILP
counts blocks per (stage, run, strategy) (planner.search.ilp).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    kind: int     # index into the kinds (first appearance order)
    first: int    # position of its first block among the blocks
    count: int


def block_kinds(blocks) -> tuple:
    """One representative Layer per kind, in order of first appearance."""
    seen: dict[str, object] = {}
    for block in blocks:
        seen.setdefault(block.signature, block)
    return tuple(seen.values())


def block_runs(blocks) -> tuple[Run, ...]:
    """Maximal runs of consecutive blocks with the same signature."""
    kinds = {layer.signature: i for i, layer in enumerate(block_kinds(blocks))}
    runs: list[Run] = []
    for i, block in enumerate(blocks):
        kind = kinds[block.signature]
        if runs and runs[-1].kind == kind:
            runs[-1] = Run(kind, runs[-1].first, runs[-1].count + 1)
        else:
            runs.append(Run(kind, i, 1))
    return tuple(runs)


def describe(blocks) -> str:
    """'blocks 0-1 (kind 0, 12 nodes), blocks 2-3 (kind 1, 15 nodes)'; a model of several parts
    names each part's blocks by the part: 'vision_tower 0-21 (kind 0, 40 nodes), ...'."""
    kinds, runs = block_kinds(blocks), block_runs(blocks)
    labels = part_labels(b.name.rpartition(".")[0] for b in blocks)
    if len(runs) > 6:  # an alternating pattern: say how many of each, not every run
        counts = [sum(r.count for r in runs if r.kind == k) for k in range(len(kinds))]
        return (f"{len(blocks)} blocks in {len(runs)} runs: " + ", ".join(
            f"{n} of kind {k} ({len(kinds[k].nodes)} nodes, first block {kinds[k].name})"
            for k, n in enumerate(counts)))
    parts = []
    for run in runs:
        first, last = blocks[run.first], blocks[run.first + run.count - 1]
        prefix, _, a = first.name.rpartition(".")
        label, b = labels.get(prefix, "blocks"), last.name.rpartition(".")[2]
        if label == "blocks" or len(labels) < 2:
            a, b = run.first, run.first + run.count - 1
            span = f"block {a}" if run.count == 1 else f"blocks {a}-{b}"
        else:
            span = f"{label} {a}" if run.count == 1 else f"{label} {a}-{b}"
        parts.append(f"{span} (kind {run.kind}, {len(kinds[run.kind].nodes)} nodes)")
    return ", ".join(parts)


def part_labels(parts) -> dict[str, str]:
    """Short names of a model's parts (its lists of blocks) for the plan: the first component
    of their paths that differs ("model.vision_tower.encoder.layers",
    "model.language_model.layers" -> "vision_tower", "language_model"); "blocks" for a model of
    one part."""
    parts = list(dict.fromkeys(parts))
    if len(parts) < 2:
        return {p: "blocks" for p in parts}
    split = [p.split(".") for p in parts]
    common = 0
    while all(len(s) > common + 1 for s in split) and len({s[common] for s in split}) == 1:
        common += 1
    labels = {p: s[common] for p, s in zip(parts, split)}
    if len(set(labels.values())) < len(parts):  # they differ only further in: the whole rest
        labels = {p: ".".join(s[common:]) for p, s in zip(parts, split)}
    return labels
