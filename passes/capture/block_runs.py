"""The repeated blocks of a captured model as an ordered sequence of runs of identical blocks.

Blocks are identical when their graphs are (passes.capture.trace's signature: the same ops on the same
shapes, the block's own name aside). Each distinct signature is a kind, numbered in order of first
appearance; a run is a maximal stretch of consecutive blocks of one kind. A model of identical
blocks is one run of kind 0; "two dense blocks, then MoE blocks" is two runs; an alternating
pattern A B A B is four runs of two kinds. The planner prices one block per kind and the stage ILP
counts blocks per (stage, run, strategy) (planner.search.ilp).
"""
from __future__ import annotations

from collections import Counter
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


def describe(blocks, graph_nodes: dict | None = None, counts=None) -> str:
    """'blocks 0-1 (kind 0, 12 nodes), blocks 2-3 (kind 1, 15 nodes)'; a model of several parts
    names each part's blocks by the part: 'vision_tower 0-21 (kind 0, 40 nodes), ...'. Given
    the graph's nodes by name, a kind says how its ops differ from the first kind of its part.
    `counts`: the model's (kind, count) runs where `blocks` holds one block per kind (a preset
    captured that way), spans numbered by the model's blocks."""
    kinds, runs = block_kinds(blocks), block_runs(blocks)
    labels = part_labels(b.name.rpartition(".")[0] for b in blocks)
    total = len(blocks)
    if counts is not None:
        firsts = [sum(n for _, n in counts[:i]) for i in range(len(counts))]
        runs = tuple(Run(k, first, n) for (k, n), first in zip(counts, firsts))
        labels, total = {}, sum(n for _, n in counts)

    def details(k: int) -> str:
        size = _count(len(kinds[k].nodes), "node")
        part = kinds[k].name.rpartition(".")[0]
        base = next((b for b in range(k) if kinds[b].name.rpartition(".")[0] == part), None)
        if graph_nodes is None or base is None:  # the first kind of its part
            return size
        return f"{size}; {differs(kinds[k], base, kinds[base], graph_nodes)}"

    if len(runs) > 6:  # an alternating pattern: say how many of each, not every run
        counts = [sum(r.count for r in runs if r.kind == k) for k in range(len(kinds))]
        return (f"{total} blocks in {len(runs)} runs: " + ", ".join(
            f"{n} of kind {k} (first block {kinds[k].name}, {details(k)})"
            for k, n in enumerate(counts)))
    parts = []
    for run in runs:
        label = a = b = None
        if counts is None:
            first, last = blocks[run.first], blocks[run.first + run.count - 1]
            prefix, _, a = first.name.rpartition(".")
            label, b = labels.get(prefix, "blocks"), last.name.rpartition(".")[2]
        if label in (None, "blocks") or len(labels) < 2:
            a, b = run.first, run.first + run.count - 1
            span = f"block {a}" if run.count == 1 else f"blocks {a}-{b}"
        else:
            span = f"{label} {a}" if run.count == 1 else f"{label} {a}-{b}"
        parts.append(f"{span} (kind {run.kind}, {details(run.kind)})")
    return ", ".join(parts)


def differs(kind, number: int, base, graph_nodes: dict) -> str:
    """How a kind's ops differ from those of `base`, kind `number` of the same part: 'beside kind
    0: +linear x2, +masked_scatter, -dropout' (the four largest differences), or that only
    shapes or constants do."""
    ops = [Counter(_op(graph_nodes[n], layer.name) for n in layer.nodes if n in graph_nodes
                   and graph_nodes[n].op in ("call_function", "call_method", "call_module"))
           for layer in (kind, base)]
    changes = [(n, f"+{op}") for op, n in (ops[0] - ops[1]).items()]
    changes += [(n, f"-{op}") for op, n in (ops[1] - ops[0]).items()]
    if not changes:
        return f"the ops of kind {number} on other shapes or constants"
    changes.sort(key=lambda c: -c[0])
    shown = ", ".join(f"{text} x{n}" if n > 1 else text for n, text in changes[:4])
    return f"beside kind {number}: {shown}{' ...' if len(changes) > 4 else ''}"


def _op(node, layer: str) -> str:
    """An op's name; a module's path inside its block (the block itself: "block")."""
    target = node.target
    if isinstance(target, str):
        return target.removeprefix(layer).lstrip(".") or "block"
    return str(getattr(target, "__name__", target)).split(".")[0]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
