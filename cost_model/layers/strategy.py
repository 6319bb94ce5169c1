"""A layer's parallel strategy: tensor parallel, Megatron sequence parallel, recomputation."""
from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, order=True)
class Strategy:
    tp: bool = False
    sp: bool = False          # sequence parallel in the non-TP regions (requires tp)
    recompute: str = "none"   # "none" | "selective" (attention core) | "full" (whole layer)

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.sp and not self.tp:
            raise ValueError("sequence parallel (sp) requires tensor parallel (tp)")

    def __str__(self) -> str:
        parts = [p for p, on in (("tp", self.tp), ("sp", self.sp)) if on]
        if self.recompute != "none":
            parts.append({"selective": "sel", "full": "full"}[self.recompute])
        return "+".join(parts) or "none"

    @staticmethod
    def parse(text: str) -> "Strategy":
        parts = set(text.split("+")) - {"none"}
        unknown = parts - {"tp", "sp", "sel", "full"}
        if unknown or ("sel" in parts and "full" in parts):
            raise ValueError(f"bad strategy {text!r}: use 'none' or a '+'-joined subset of "
                             f"tp, sp and one of sel/full, e.g. 'tp+sp+sel'")
        recompute = "selective" if "sel" in parts else "full" if "full" in parts else "none"
        return Strategy("tp" in parts, "sp" in parts, recompute)


def strategy_space(tp: int) -> list[Strategy]:
    """Strategies to consider for a block at tensor-parallel size tp: with or without tp, sequence
    parallel with tp, and each recomputation (the rewrite passes build every one of them)."""
    tps = [False, True] if tp > 1 else [False]
    space = []
    for t in tps:
        for sp in ([False, True] if t else [False]):
            space += [Strategy(t, sp, r) for r in RECOMPUTE]
    return space
