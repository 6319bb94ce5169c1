"""Random small models × random fixed plans, trained on gloo ranks and compared with one process.

The property behind tests/dist/test_fuzz.py and examples/fuzz.py: whatever plan the planner accepts
for whatever model, a few training steps on `gpus` ranks give the losses, every gradient and the
final parameters of the same model trained in one process (planner.training.local.assert_same_run).

`build_case(choose)` makes a case from a sequence of choices, each `choose(options)` with the
simplest option first; `cases()` makes those choices through hypothesis (which then shrinks a
failure towards the first options) and `Chooser` at random from a seed or by replaying indices
(examples/fuzz.py, which shrinks the same way). The mesh comes first and the model is steered
towards it (heads a multiple of tp, a sequence cp can split, layers for every stage), so most cases
are plans the planner accepts; one it refuses (PlanningError / ValueError) is `Refused`, not a
failure. Every case has a replayable repr: `Case(config=ModelConfig(...), gpus=..., ...)`.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from planner.models.presets import ModelConfig
from planner.search.plan import Plan

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1")
# Strategy texts `fix={"strategy": ...}` accepts (cost_model.layers.strategy.Strategy.parse); None leaves
# each block's strategy to the planner, which may mix them.
TP_STRATEGIES = ("tp", "tp+sp", "tp+sel", "tp+full", "tp+sp+sel", "tp+sp+full")
NO_TP_STRATEGIES = ("none", "sel", "full")
VOCABS = (64, 61, 97, 128, 131)      # primes pad under vocabulary-parallel tp
MAX_LAYERS = 4

Choose = Callable[[Sequence], object]


@dataclass(frozen=True)
class Case:
    """A model, a rank count and the plan asked for: `fix` as planner.api.plan takes it, or with
    `stages` (each pipeline stage's block strategies) or `ends` ("vocab-tp": embedding and head
    split over the vocabulary) a configuration priced as given (planner.interop.configuration)."""
    config: ModelConfig
    gpus: int
    fix: dict = field(default_factory=dict)
    steps: int = 2
    stages: tuple[tuple[str, ...], ...] | None = None
    ends: str = "auto"

    def line(self) -> str:
        """The model and the requested plan on one line."""
        c = self.config
        kv = f" kv{c.n_kv_heads}" if c.n_kv_heads != c.heads else ""
        model = (f"{c.arch} L{c.layers} h{c.hidden} heads{c.heads}{kv} ffn{c.ffn_hidden} "
                 f"V{c.vocab} s{c.seq} {c.attention}{' tied' if c.tie else ''} "
                 f"B{c.global_batch}")
        plan = " ".join(f"{k}={v}" for k, v in self.fix.items())
        if self.stages is not None:
            plan += " stages=" + "/".join(",".join(stage) for stage in self.stages)
        if self.ends != "auto":
            plan += f" ends={self.ends}"
        return f"{model} | {self.gpus} ranks {plan} | {self.steps} steps"


class Refused(Exception):
    """The planner does not accept the case's fixed settings for its model."""


def _mesh_list(gpus: int) -> list[tuple[int, int, int, int]]:
    """(dp, tp, pp, cp) with product gpus and pp ≤ MAX_LAYERS + 2 (embed and head may take a
    stage each), simplest first."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    meshes = [(gpus // (tp * pp * cp), tp, pp, cp)
              for tp in divisors for pp in divisors for cp in divisors
              if gpus % (tp * pp * cp) == 0 and pp <= MAX_LAYERS + 2]
    return sorted(meshes, key=lambda m: (sum(n > 1 for n in m[1:]), m[1] * m[2] * m[3], m))


def build_model_config(choose: Choose, tp: int = 1, cp: int = 1, min_layers: int = 1,
                       seq_multiple: int = 1) -> ModelConfig:
    """A tiny GPT or Llama: heads a multiple of tp, 1-4 layers (more only where min_layers
    asks: interleaving over 4 ranks needs 6), a sequence that is a multiple of seq_multiple and
    splits into 2·cp chunks (global_batch is set by `build_case`). Hidden sizes stay at 8 or
    more: a norm over 2 or 3 features is so ill-conditioned that summation order alone moves
    gradients past rtol."""
    arch = choose(("gpt", "llama"))
    layers = choose(range(min_layers, max(min_layers, MAX_LAYERS) + 1))
    heads = tp * choose((1, 2))
    dims = (4, 2, 8) if arch == "llama" else (4, 2, 3, 8)
    head_dim = choose([d for d in dims if heads * d >= 8])
    hidden = heads * head_dim
    kv_heads = None
    if arch == "llama":
        kv_heads = choose([d for d in range(heads, 0, -1) if heads % d == 0])
    ffn = choose((None, 2 * hidden, 3 * hidden))
    vocab = choose(VOCABS)
    step = math.lcm(seq_multiple, 2 * cp if cp > 1 else 1)
    seq = step * choose(range(-(-8 // step), 32 // step + 1))
    return ModelConfig(arch, layers, hidden, heads, vocab, seq, kv_heads=kv_heads, ffn=ffn,
                       attention=choose(("sdpa", "math")), tie=choose((False, True)))


def _split(blocks: tuple[str, ...], stages: int) -> tuple[tuple[str, ...], ...]:
    """Blocks over stages as evenly as whole blocks allow; with fewer blocks than stages, the
    first and then the last stage hold only the embedding or the head."""
    empty = max(stages - len(blocks), 0)
    inner = stages - empty
    sizes = [len(blocks) // inner + (s < len(blocks) % inner) for s in range(inner)]
    sizes = [0] * (empty > 0) + sizes + [0] * (empty > 1)
    starts = [sum(sizes[:s]) for s in range(stages)]
    return tuple(blocks[a:a + n] for a, n in zip(starts, sizes))


def build_case(choose: Choose, worlds: Sequence[int] = (4, 8)) -> Case:
    """A mesh, a schedule, a micro-batching and the blocks' strategies: one for all of them, the
    planner's choice per block, or one drawn for each block (priced as given); with tp, the
    embedding and head as the planner prices them or split over the vocabulary. Then a model they
    fit: enough layers for every stage (pp·v ≤ layers + 2, embed and head may take one each)
    and, under sequence parallel, a sequence that tp·cp divides."""
    gpus = choose(worlds)
    dp, tp, pp, cp = choose(_mesh_list(gpus))
    schedule = choose(SCHEDULES) if pp > 1 else "1f1b"
    v = 2 if schedule == "interleaved-1f1b" else 1
    mb = choose((1, 2))
    # Interleaved 1F1B runs micro-batches in groups of pp.
    m = pp * choose((1, 2)) if v > 1 else choose((1, 2, 3, 4))
    options = TP_STRATEGIES if tp > 1 else NO_TP_STRATEGIES
    per_block = choose((False, True))
    strategy = None if per_block else choose((None,) + options)
    sp = (per_block and tp > 1 and choose((False, True))) or (
        strategy is not None and "sp" in strategy.split("+"))
    config = build_model_config(choose, tp, cp, max(1, pp * v - 2), tp * cp if sp else 1)
    stages = None
    if per_block:
        legal = [s for s in options if sp or "sp" not in s.split("+")] + ["none"] * (tp > 1)
        stages = _split(tuple(choose(legal) for _ in range(config.layers)), pp * v)
    ends = choose(("auto", "vocab-tp")) if tp > 1 and (per_block or strategy) else "auto"
    fix = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "mb": mb, "schedule": schedule}
    if v > 1:
        fix["v"] = v
    if strategy is not None:
        fix["strategy"] = strategy
    return Case(config.with_(global_batch=dp * mb * m), gpus, fix, choose((2, 3)), stages, ends)


def cases(worlds: Sequence[int] = (4, 8)):
    """The hypothesis strategy of `build_case` (hypothesis comes with the `test` extra)."""
    from hypothesis import strategies as st

    @st.composite
    def draw_case(draw):
        return build_case(lambda options: draw(st.sampled_from(list(options))), worlds)
    return draw_case()


class Chooser:
    """`choose` for build_case: replays `indices` (clamped to each choice's options), then picks
    at random from rng, or the first option without one. `made` records the indices taken."""

    def __init__(self, rng: random.Random | None = None, indices: Sequence[int] = ()):
        self.rng, self.indices, self.made = rng, list(indices), []

    def __call__(self, options: Sequence):
        options = list(options)
        i = len(self.made)
        if i < len(self.indices):
            k = min(self.indices[i], len(options) - 1)
        else:
            k = self.rng.randrange(len(options)) if self.rng else 0
        self.made.append(k)
        return options[k]


def shrink(indices: Sequence[int], still_fails: Callable[[Case], bool],
           worlds: Sequence[int] = (4, 8), log: Callable[[str], None] = print) -> list[int]:
    """Greedy shrinking of a failing case's choices: each index, in order, to the smallest one
    (simpler options come first) that still fails; repeated until nothing changes."""
    best = Chooser(indices=indices)
    build_case(best, worlds)
    best = best.made
    changed = True
    while changed:
        changed = False
        for i in range(len(best)):
            for k in range(best[i]):
                trial = Chooser(indices=best[:i] + [k] + best[i + 1:])
                case = build_case(trial, worlds)
                if trial.made != best and still_fails(case):
                    log(f"  smaller: {case.line()}")
                    best, changed = trial.made, True
                    break
    return best


def plan_case(case: Case) -> Plan:
    """The planner's plan for the case (planner.api.plan, or planner.interop.configuration for stages or ends
    given), checked against what the case asks; `Refused` when the planner raises
    PlanningError/ValueError (a ValueError subclass)."""
    from planner.api import plan
    from planner.interop.configuration import Configuration, Pricer, block_strategies
    fix = case.fix
    try:
        if case.stages is None and case.ends == "auto":
            chosen = plan(case.config, case.gpus, cluster="cpu-gloo", fix=fix)[0]
        else:
            asked = Configuration(fix["dp"], fix["tp"], fix["pp"], fix["cp"], fix["mb"],
                                  fix["schedule"], fix.get("v", 1), case.stages,
                                  fix.get("strategy"), case.ends)
            chosen = Pricer(case.config, case.gpus, cluster="cpu-gloo").price(asked).plan
    except ValueError as err:
        raise Refused(f"{type(err).__name__}: {err}") from err
    def per_stage(stages):  # a priced stage lists its blocks by strategy, not in the order given
        return [sorted(stage) for stage in stages]
    if case.stages is not None and per_stage(block_strategies(chosen)) != per_stage(case.stages):
        raise AssertionError(f"stages {case.stages} asked, the plan has "
                             f"{block_strategies(chosen)}")
    ends = {s for stage in chosen.stages for layer, s in zip(stage.layers, stage.strategies)
            if layer in ("embed", "head")}
    if case.ends != "auto" and ends != {case.ends}:
        raise AssertionError(f"ends={case.ends} asked, the plan has {ends}")
    got = {"dp": chosen.dp, "tp": chosen.tp, "pp": chosen.pp, "cp": chosen.cp,
           "mb": chosen.micro_batch, "schedule": chosen.schedule, "v": chosen.virtual_stages}
    wrong = {k: (v, got[k]) for k, v in case.fix.items() if k in got and got[k] != v}
    if wrong:
        raise AssertionError(f"the plan ignores fixed settings (asked, got): {wrong}")
    if "strategy" in case.fix:
        blocks = {s for stage in chosen.stages for layer, s in zip(stage.layers, stage.strategies)
                  if layer not in ("embed", "head")}
        if blocks != {case.fix["strategy"]}:
            raise AssertionError(f"fixed strategy {case.fix['strategy']!r}, blocks got {blocks}")
    return chosen


def describe(chosen: Plan) -> str:
    """Per stage, each layer's strategy (what the planner decided beyond the fix)."""
    return " / ".join(",".join(stage.strategies) for stage in chosen.stages)


def train_both(case: Case, chosen: Plan, pool):
    """(parallel, one-process) RunResults of the case's steps."""
    from planner.training.local import reference_run, run_parallel
    return run_parallel(case.config, chosen, case.steps, pool), reference_run(case.config,
                                                                              case.steps)


def check(case: Case, chosen: Plan, pool) -> None:
    """Train the plan on the pool's ranks and in one process; AssertionError names what differs."""
    from planner.training.local import assert_same_run
    parallel, reference = train_both(case, chosen, pool)
    assert_same_run(parallel, reference, rtol=1e-5, what=case.line())


def within_fp32_noise(case: Case, parallel, reference, factor: float = 4.0) -> bool:
    """Whether a mismatch is fp32 summation order amplified by training: the parallel run is no
    farther from the same training in float64 than `factor` times the fp32 one-process run is
    (every gradient of every step and every final parameter), give or take 1e-6 of its scale."""
    import torch
    from planner.training.local import build, make_optimizer
    torch.manual_seed(0)
    model, batch = build(case.config)
    model = model.double()
    opt = make_optimizer(list(model.parameters()))
    exact = []
    for _ in range(case.steps):
        opt.zero_grad()
        model(*batch).backward()
        exact.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
    pairs = list(zip(parallel.grads, reference.grads, exact))
    pairs.append((parallel.state, reference.state, dict(model.named_parameters())))
    for got, fp32, want in pairs:
        for name, value in want.items():
            value = value.detach()
            far = (got[name].double() - value).abs().max().item()
            usual = (fp32[name].double() - value).abs().max().item()
            if far > factor * usual + 1e-6 * value.abs().max().item():
                return False
    return True


def known_failure(case: Case) -> str | None:
    """Why a case is expected to fail for a known, open reason, or None (none is open now)."""
    return None
