"""Every plan kind's per-rank memory, predicted, measured and dry-run, on small models (CPU).

`CASES` names one small plan per kind the planner can choose — data parallel at each ZeRO level
and hybrid sharding, tensor and sequence parallel, each pipeline schedule, context and expert
parallel, each recomputation, tied embeddings across stages, autocast mixed precision, bf16
with fp32 main weights and Hugging Face families — and `run_cases` measures each on real gloo ranks
(planner.bench.memory) and dry-runs every rank of it (planner.bench.dry_run), giving the
table docs/fidelity.md shows (`cases_table`; examples/bench_memory_plans.py prints it).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tabulate import tabulate

from planner.bench.memory import STATIC, RankMemory, predicted_split

MiB = 2**20


@dataclass(frozen=True)
class Case:
    """A plan kind: the model (a preset name or "hf:ARCH"), ranks, the plan's fixed settings
    and the runtime's options (runtime.training.trainer.TrainOptions fields)."""
    name: str
    model: str
    gpus: int
    fix: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)


CASES = (
    Case("dp zero-0", "gpt-tiny", 2, {"dp": 2}),
    Case("dp zero-1", "gpt-tiny", 2, {"dp": 2, "zero": 1}),
    Case("dp zero-2", "gpt-tiny", 2, {"dp": 2, "zero": 2}),
    Case("dp zero-3", "gpt-tiny", 2, {"dp": 2, "zero": 3}),
    Case("hybrid zero-3", "gpt-tiny", 4, {"dp": 4, "zero": 3, "dp_shard": 2}),
    Case("tp", "gpt-tiny", 2, {"tp": 2, "strategy": "tp"}),
    Case("tp+sp", "gpt-tiny", 2, {"tp": 2, "strategy": "tp+sp"}),
    Case("pp gpipe", "gpt-tiny", 2, {"pp": 2, "schedule": "gpipe", "mb": 2}),
    Case("pp 1f1b", "gpt-tiny", 2, {"pp": 2, "schedule": "1f1b", "mb": 1}),
    Case("pp interleaved", "gpt-tiny", 2, {"pp": 2, "schedule": "interleaved-1f1b", "v": 2,
                                           "mb": 1}),
    Case("pp zb-h1 retraverse", "gpt-tiny", 2, {"pp": 2, "schedule": "zb-h1", "mb": 1,
                                                "split_backward": "retraverse"}),
    Case("pp zb-h1 record", "gpt-tiny", 2, {"pp": 2, "schedule": "zb-h1", "mb": 1,
                                            "split_backward": "record"}),
    Case("pp 1f1b zero-3", "gpt-tiny", 4, {"dp": 2, "pp": 2, "zero": 3, "schedule": "1f1b",
                                           "mb": 1}),
    Case("pp zb-h1 record zero-3", "gpt-tiny", 4, {"dp": 2, "pp": 2, "zero": 3, "mb": 1,
                                                   "schedule": "zb-h1",
                                                   "split_backward": "record"}),
    Case("cp", "llama-tiny", 2, {"cp": 2}),
    Case("ep", "mixtral-tiny", 2, {"dp": 2, "ep": 2}),
    Case("recompute selective", "gpt-tiny", 2, {"dp": 2, "recompute": "selective"}),
    Case("recompute full", "gpt-tiny", 2, {"dp": 2, "recompute": "full"}),
    Case("tied, pp", "hf:gpt2", 2, {"pp": 2, "schedule": "1f1b"}),
    Case("mixed precision bf16", "gpt-tiny", 2, {"dp": 2}, {"precision": "bf16"}),
    Case("autocast bf16, pp", "gpt-tiny", 2, {"pp": 2, "schedule": "1f1b", "mb": 1},
         {"precision": "bf16"}),
    Case("hf llama tp x pp", "hf:llama", 4, {"tp": 2, "pp": 2, "strategy": "tp"}),
    Case("hf qwen2 dp x tp", "hf:qwen2", 4, {"dp": 2, "tp": 2, "strategy": "tp"}),
    Case("hf gpt2 zero-2", "hf:gpt2", 2, {"dp": 2, "zero": 2}),
    Case("bf16, fp32 main", "hf:llama", 2, {"dp": 2}, {"precision": "bf16-main"}),
)


def case_spec(case: Case):
    """The model spec a case trains: a preset at global batch 8, or a small Hugging Face
    config (planner.models.hf) at sequence 32."""
    from planner.models.hf import HFSpec
    from planner.models.presets import get_config
    if case.model.startswith("hf:"):
        return HFSpec(case.model[3:], global_batch=8, seq=32)
    return replace(get_config(case.model), global_batch=8)


def case_plan(case: Case):
    """The planner's best plan of the case on gloo CPU ranks, in the precision the ranks train
    in (fp32, or bf16 under precision "bf16-main")."""
    from planner.api import plan
    from planner.models.presets import ModelConfig
    from planner.training.local import build
    spec = case_spec(case)
    precision = case.options.get("precision")
    autocast = precision if precision in ("bf16", "fp16") else None  # priced as it runs
    if isinstance(spec, ModelConfig):
        return plan(spec, case.gpus, cluster="cpu-gloo", fix=case.fix, autocast=autocast)[0]
    model, batch = build(spec)
    if case.options.get("precision") == "bf16-main":  # planned as the ranks train it: bf16
        from planner.api import in_compute_dtype
        model, batch = in_compute_dtype(model, batch)
    return plan(model, case.gpus, batch, cluster="cpu-gloo", fix=case.fix, autocast=autocast)[0]


@dataclass(frozen=True)
class CaseResult:
    case: Case
    plan_text: str
    predicted: tuple[dict, ...]
    measured: tuple[RankMemory, ...]
    dry: tuple[RankMemory, ...]


def run_case(case: Case, pool) -> CaseResult:
    """Measure a case on `pool`'s ranks and dry-run each of its ranks here."""
    from planner.bench.memory import measure_worker
    from planner.bench.dry_run import dry_run
    plan = case_plan(case)
    spec = case_spec(case)
    measured = pool.run(measure_worker, spec, plan.dumps(), 2, case.options)
    # The dry run routes as the measured ranks did: routing is data, not the programs' memory.
    dry = dry_run(spec, plan, options=case.options, routing=[m.routing for m in measured])
    layout = (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} cp={plan.cp} zero={plan.zero} "
              f"{plan.schedule} mb={plan.micro_batch}x{plan.num_microbatches}")
    return CaseResult(case, layout, tuple(predicted_split(plan)), tuple(measured), tuple(dry))


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf") if a else 1.0


def case_rows(result: CaseResult) -> list[list]:
    """One row per rank: predicted / measured / dry-run MiB of the static part and the total,
    and the three ratios the acceptance reads."""
    rows = []
    for p, m, d in zip(result.predicted, result.measured, result.dry):
        p_static, p_total = sum(p[k] for k in STATIC), sum(p.values())
        rows.append([result.case.name, m.rank, f"{p_static / MiB:.2f}",
                     f"{m.static_bytes / MiB:.2f}", f"{p_total / MiB:.2f}",
                     f"{m.peak_bytes / MiB:.2f}", f"{d.peak_bytes / MiB:.2f}",
                     f"{_ratio(p_static, m.static_bytes):.3f}",
                     f"{_ratio(p_total, m.peak_bytes):.3f}",
                     f"{_ratio(d.peak_bytes, m.peak_bytes):.3f}"])
    return rows


HEADERS = ["plan kind", "rank", "pred static", "meas static", "pred total", "meas total",
           "dry total", "static p/m", "total p/m", "dry/meas"]


def cases_table(results: list[CaseResult]) -> str:
    rows = [row for r in results for row in case_rows(r)]
    return tabulate(rows, headers=HEADERS, disable_numparse=True)
