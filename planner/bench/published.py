"""Published measured training runs priced by fxpar: the check of the GPU cost model against them
(`fxpar validate`, examples/bench_published.py).

planner/bench/published/ holds the runs as CSV files, one per source, whose header comments name
the source (document, table, address), and models.json, how fxpar builds each CSV "model": a
preset with overrides, or a Hugging Face config.json under configs/, with a note of what fxpar
cannot express for it. Each row becomes one fixed configuration (`fix_of`), priced by
planner.api.plan under a cluster profile (default h100-sxm-dgx):

  tp, pp, cp, ep   as published ("-": 1)
  vp               v = vp with schedule interleaved-1f1b when vp > 1; schedule 1f1b when pp > 1
  mbs              mb (the micro-batch); the micro-batches per step follow from gbs, mbs and dp
  lbs, ga          with pp > 1 and lbs x ga x dp = gbs, the run called its pipeline schedule once
                   per local batch, ga flushes a step (NeMo AutoModel's loop over
                   torch.distributed.pipelining): priced as ga steps of gbs / ga (`Row.flushes`);
                   otherwise one flush of every micro-batch (Megatron-Core's schedule)
  recompute        optional column: none, selective or full, as the run's recipe says
                   (recompute=); "-" or no column: the planner's choice
  fsdp             zero=3 with dp_shard = fsdp. The tables' FSDP degree is the data-parallel shard
                   size with cp apart: NeMo AutoModel and torchtitan shard parameters over
                   dp_shard x cp (AutoModel's Llama3 70B row: 64 GPUs = cp 2 x fsdp 32), and so do
                   fxpar's ZeRO levels (planner.search.zero: over dp_shard x cp, replicated across
                   dp / dp_shard), so dp_shard = fsdp says the same thing; fsdp = dp is plain FSDP,
                   fsdp < dp hybrid sharding.
                   "-": data parallel with the optimizer state sharded (Megatron's distributed
                   optimizer), zero=1
  gpus, gbs, seq   the request

  kernels          the attention kernel where the row names one ("FlexAttn", "triton", "FA2"),
                   else the runtime's own; "fused cross-entropy": the loss as one kernel
                   (Cluster.fused_loss)
  runtime          the training framework that ran the row (cost_model.hardware.runtimes): the
                   file's "# runtime:" line, or a runtime column; its profile decides what the
                   hardware's rates become (fusion, overlap, attention kernel, launches)
  cluster          the profile of the hardware, named by the file's "# cluster:" line
  routing          the file's "# routing:" line: "router" (default; a trained or random router,
                   priced as uniform routing with its expected load imbalance) or "round-robin"
                   (a fake balanced gate: equal loads, consecutive experts per token,
                   Cluster.round_robin_routing)

A cell "?" marks a value the source does not print (a micro-batch, a sequence length, an
interleaving depth, a step time that needs one): the row is listed with what is missing, never
priced on a guess.

The rest (the stage split, recomputation where no recompute is given) is the planner's choice. Throughput is compared per GPU:
tokens/s per GPU = gbs x seq / (step s x gpus); rows of one model and GPU count are ranked by it.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cost_model.hardware.runtimes import RUNTIMES, apply
from cost_model.layers.strategy import RECOMPUTE, Strategy

FOLDER = Path(__file__).with_name("published")
MODELS_FILE = FOLDER / "models.json"
DEFAULT_CLUSTER = "h100-sxm-dgx"
COLUMNS = ("model", "gpus", "gbs", "mbs", "lbs", "ga", "seq", "tp", "pp", "cp", "ep", "vp",
           "fsdp", "kernels", "step_s", "model_tflops_per_gpu", "tokens_per_s_per_gpu")
_COUNTS = ("gpus", "gbs", "mbs", "seq", "tp", "pp", "cp")
_OPTIONAL_COUNTS = ("ep", "vp", "fsdp", "lbs", "ga")       # "-": not used or not published
ROUTINGS = ("router", "round-robin")
_TIMES = ("step_s", "tokens_per_s_per_gpu")
MISSING = "?"    # a cell the source does not print
CLOSE = 0.05     # a measured-fastest row predicted within 5% of the predicted fastest


@dataclass(frozen=True)
class Row:
    """One published run, as its CSV row says."""
    source: str                  # the CSV file's name
    line: int                    # its line in the file
    model: str
    gpus: int
    gbs: int
    mbs: int
    seq: int
    tp: int
    pp: int
    cp: int
    ep: int | None
    vp: int | None
    fsdp: int | None
    kernels: str
    step_s: float
    tokens_per_s_per_gpu: float
    cluster: str = DEFAULT_CLUSTER  # the hardware it ran on: the file's "# cluster:" line
    lbs: int | None = None       # sequences per data-parallel rank per schedule call
    ga: int | None = None        # local batches per step
    recompute: str | None = None  # as the run's recipe says; None: not published
    routing: str = "router"      # the file's "# routing:" line
    runtime: str = "fxpar"       # the framework that ran it (cost_model.hardware.runtimes)
    missing: tuple[str, ...] = ()  # columns the source does not print ("?"): not priced
    sp: bool = False             # sequence parallelism with tp (the sp column)

    @property
    def attention(self) -> str | None:
        """The attention kernel the row names, or None for its runtime's own."""
        text = self.kernels.lower().replace("-", "")
        return next((kernel for word, kernel in _ATTENTION_WORDS if word in text), None)

    @property
    def fused_loss(self) -> bool:
        """The row's kernels name a fused cross-entropy (Cluster.fused_loss)."""
        return "fusedcrossentropy" in self.kernels.lower().replace("-", "").replace(" ", "")

    @property
    def flushes(self) -> int:
        """Pipeline flushes per step: ga where the run called its schedule once per local batch
        (lbs x ga x dp = gbs with pp > 1), else one."""
        ga, lbs = self.ga or 1, self.lbs or 0
        return ga if self.pp > 1 and ga > 1 and lbs * ga * self.dp == self.gbs else 1

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def configuration(self) -> str:
        """'tp=1 pp=4 v=8 ep=64 fsdp=64 mb=1 gbs=512 seq=4096' (cp, ep and v shown when used)."""
        if self.missing:
            return " ".join(f"{c}={getattr(self, c) if c not in self.missing else '?'}"
                            for c in ("tp", "pp", "vp", "cp", "mbs", "gbs", "seq")
                            if getattr(self, c) not in (None, 1) or c in self.missing)
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"v={self.vp}"] if (self.vp or 1) > 1 else []
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += [f"ep={self.ep}"] if (self.ep or 1) > 1 else []
        parts += [f"fsdp={self.fsdp}" if self.fsdp else "ddp"]
        parts += ["sp"] if self.sp else []
        parts += [f"mb={self.mbs}", f"gbs={self.gbs}", f"seq={self.seq}"]
        parts += [f"{self.flushes} flushes"] if self.flushes > 1 else []
        return " ".join(parts + ([f"recompute={self.recompute}"] if self.recompute else []))


# Words of a row's kernels column that name its attention kernel (runtimes.ATTENTION_SHARE)
_ATTENTION_WORDS = (("flexattn", "flex"), ("triton", "triton"), ("flashattention2", "fa2"),
                    ("fa2", "fa2"))


@dataclass(frozen=True)
class ModelSpec:
    """How fxpar builds a CSV model: a preset with overrides, or a Hugging Face config file."""
    name: str
    preset: str | None = None
    overrides: tuple[tuple[str, int], ...] = ()
    hf_config: str | None = None  # a path relative to the published folder
    note: str = ""
    unsupported: str = ""         # why fxpar cannot build it: its rows are listed, not priced


@dataclass(frozen=True)
class Result:
    """A row priced (predicted_s and its parts) or not (reason)."""
    row: Row
    fix: tuple[tuple[str, object], ...]
    predicted_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None      # exposed communication
    bubble_s: float | None = None
    reason: str = ""
    # priced although fxpar's memory model says the plan does not fit the device (the run did):
    # what fxpar estimated against what the device has
    memory_note: str = ""

    @property
    def priced(self) -> bool:
        return self.predicted_s is not None

    @property
    def error_pct(self) -> float | None:
        """(predicted - published) / published step time, in percent."""
        return error_pct(self.predicted_s, self.row.step_s) if self.priced else None

    @property
    def predicted_tokens_per_s_per_gpu(self) -> float | None:
        if not self.priced:
            return None
        return self.row.gbs * self.row.seq / (self.predicted_s * self.row.gpus)


@dataclass(frozen=True)
class Summary:
    rows: int
    priced: int
    median_abs_error_pct: float | None
    max_abs_error_pct: float | None
    within_10: int
    within_20: int


@dataclass(frozen=True)
class Ranking:
    """The rows of one model on one GPU count, fastest first by tokens/s per GPU."""
    model: str
    gpus: int
    measured: tuple[Result, ...]
    predicted: tuple[Result, ...]
    unpriced: tuple[Result, ...]
    verdict: str


@dataclass(frozen=True)
class Validation:
    cluster: str
    results: tuple[Result, ...]
    summary: Summary
    rankings: tuple[Ranking, ...]
    notes: tuple[tuple[str, str], ...]   # (model, what fxpar cannot express for it)


# ---- reading ---------------------------------------------------------------------------------

def csv_files(folder: Path = FOLDER) -> list[Path]:
    files = sorted(folder.glob("*.csv"), key=lambda f: f.stem)
    if not files:
        raise ValueError(f"no published runs: {folder} has no .csv file")
    return files


def read_rows(path: str | Path) -> list[Row]:
    """The rows of one CSV file; '#' lines are comments, of which "# cluster: NAME" names the
    profile (a preset of cost_model.hardware.cluster) of the hardware the rows ran on (default
    h100-sxm-dgx). ValueError names the file and line."""
    path = Path(path)
    text = _read_text(path)
    cluster = _cluster_line(path, text)
    routing = _header(path, text, "routing") or "router"
    if routing not in ROUTINGS:
        raise ValueError(f"{path}: '# routing: {routing}' is not one of {', '.join(ROUTINGS)}")
    lines = [(n, text) for n, text in enumerate(text.splitlines(), 1)
             if text.strip() and not text.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{path}: no header line and no rows")
    header = next(csv.reader([lines[0][1]]))
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path}: missing columns {', '.join(missing)} (expected "
                         f"{','.join(COLUMNS)})")
    rows = []
    for n, values in zip((n for n, _ in lines[1:]), csv.reader(t for _, t in lines[1:])):
        if len(values) != len(header):
            raise ValueError(f"{path} line {n}: {len(values)} fields, the header has "
                             f"{len(header)}")
        rows.append(_row(path.name, n, dict(zip(header, (v.strip() for v in values)))))
    runtime = _runtime_line(path, text)
    rows = [dataclasses.replace(r, runtime=runtime) if r.runtime == "fxpar" else r
            for r in rows]
    for r in rows:
        if r.runtime not in RUNTIMES:
            raise ValueError(f"{path} line {r.line}: runtime {r.runtime!r} is not one of "
                             f"{', '.join(RUNTIMES)}")
    return [dataclasses.replace(r, cluster=cluster, routing=routing) for r in rows]


def _runtime_line(path: Path, text: str) -> str:
    name = _header(path, text, "runtime") or "fxpar"
    if name not in RUNTIMES:
        raise ValueError(f"{path}: '# runtime: {name}' is not one of {', '.join(RUNTIMES)}")
    return name


def _cluster_line(path: Path, text: str) -> str:
    from cost_model.hardware.cluster import PRESETS
    name = _header(path, text, "cluster")
    if name and name not in PRESETS:
        raise ValueError(f"{path}: '# cluster: {name}' is not a cluster preset; presets: "
                         f"{', '.join(sorted(PRESETS))}")
    return name or DEFAULT_CLUSTER


def _header(path: Path, text: str, key: str) -> str | None:
    """The value of the file's one "# key: value" comment line, or None."""
    values = [line.split(":", 1)[1].strip() for line in text.splitlines()
              if line.lstrip().startswith("#") and line.lstrip("# ").lower().startswith(key + ":")]
    if len(values) > 1:
        raise ValueError(f"{path}: {len(values)} '# {key}:' lines; give one")
    return values[0] if values else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a CSV file: not UTF-8 text") from None


def _row(source: str, line: int, cells: dict[str, str]) -> Row:
    where = f"{source} line {line}"
    if not cells["model"]:
        raise ValueError(f"{where}: empty model")
    missing = tuple(c for c in _COUNTS + _OPTIONAL_COUNTS + _TIMES if cells[c] == MISSING)
    values = {c: _count(cells[c], c, where) for c in _COUNTS if c not in missing}
    values |= {c: None if cells[c] == "-" else _count(cells[c], c, where)
               for c in _OPTIONAL_COUNTS if c not in missing}
    values |= {c: _positive(cells[c], c, where) for c in _TIMES if c not in missing}
    recompute = cells.get("recompute", "-")
    if recompute not in ("-",) + RECOMPUTE:
        raise ValueError(f"{where}: recompute must be one of -, {', '.join(RECOMPUTE)}, got "
                         f"{recompute!r}")
    runtime = {"runtime": cells["runtime"]} if cells.get("runtime") else {}
    if cells.get("sp", "-") not in ("-", "1"):
        raise ValueError(f"{where}: sp must be 1 (sequence parallel) or -, got {cells['sp']!r}")
    runtime["sp"] = cells.get("sp") == "1"
    return Row(source, line, cells["model"], kernels=cells["kernels"],
               recompute=None if recompute == "-" else recompute, missing=missing,
               **{c: None for c in missing}, **runtime, **values)


def _count(text: str, column: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{where}: {column} must be a positive integer, got {text!r}"
                         + (f' ("-" is allowed for {", ".join(_OPTIONAL_COUNTS)} only)'
                            if text == "-" else ""))
    return int(text)


def _positive(text: str, column: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{where}: {column} must be a positive number, got {text!r}")
    return value


def load_models(path: str | Path = MODELS_FILE) -> dict[str, ModelSpec]:
    """models.json: {"models": {name: {"preset", "overrides"} or {"hf_config"} or
    {"unsupported": why}, "note"}}."""
    try:
        data = json.loads(_read_text(Path(path)))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise ValueError(f'{path}: expected an object with a "models" object')
    return {name: _spec(name, entry, path) for name, entry in data["models"].items()}


def _spec(name: str, entry, path) -> ModelSpec:
    from planner.models.presets import ModelConfig
    where = f"{path}: model {name!r}"
    if not isinstance(entry, dict) or \
            sum(k in entry for k in ("preset", "hf_config", "unsupported")) != 1:
        raise ValueError(f'{where}: give one of "preset" (with "overrides"), "hf_config" or '
                         f'"unsupported"')
    unknown = sorted(set(entry) - {"preset", "overrides", "hf_config", "note", "unsupported"})
    overrides = entry.get("overrides", {})
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown or not isinstance(overrides, dict) or set(overrides) - fields:
        raise ValueError(f"{where}: unknown keys {unknown or sorted(set(overrides) - fields)}")
    return ModelSpec(name, entry.get("preset"), tuple(sorted(overrides.items())),
                     entry.get("hf_config"), str(entry.get("note", "")),
                     str(entry.get("unsupported", "")))


# ---- one row -----------------------------------------------------------------------------------

def fix_of(row: Row) -> dict:
    """The fixed configuration the row's columns say (see the module's docstring)."""
    if row.gpus % (row.tp * row.pp * row.cp):
        raise ValueError(f"{row.gpus} GPUs do not split into tp={row.tp} x pp={row.pp} x "
                         f"cp={row.cp}")
    fix = {"tp": row.tp, "pp": row.pp, "cp": row.cp, "ep": row.ep or 1, "mb": row.mbs}
    v = row.vp or 1
    if v > 1 and row.pp == 1:
        raise ValueError(f"vp={v} virtual stages need pp > 1")
    if row.pp > 1:
        fix |= {"v": v, "schedule": "interleaved-1f1b" if v > 1 else "1f1b"}
    if row.sp and (row.tp == 1 or not row.recompute):
        raise ValueError("sp=1 needs tp > 1 and a recompute column")
    if row.recompute:
        fix |= {"recompute": row.recompute}
    if row.tp > 1 and row.recompute:   # every block tensor-parallel, as the run split them
        fix |= {"strategy": str(Strategy(True, row.sp, row.recompute))}
    if row.fsdp is None:
        return fix | {"zero": 1}
    if row.dp % row.fsdp:
        raise ValueError(f"fsdp={row.fsdp} does not divide dp = gpus / (tp x pp x cp) = {row.dp}")
    return fix | {"zero": 3, "dp_shard": row.fsdp}


def error_pct(predicted: float, published: float) -> float:
    return (predicted - published) / published * 100.0


@functools.lru_cache(maxsize=4)
def _hf_module(path: str):
    """A Hugging Face model on the meta device, its experts as one routed op (as `fxpar plan`
    builds it)."""
    import torch

    from planner.models.hf import build_hf_from_file
    from planner.models.hf_moe import has_experts, use_routed_experts
    with torch.device("meta"):
        model = build_hf_from_file(path)
    if has_experts(model):
        use_routed_experts(model)
    return model


def model_inputs(spec: ModelSpec, gbs: int, seq: int):
    """(model, example inputs) for planner.api.plan: a preset config, or a meta HF model with a
    meta batch of gbs sequences of seq tokens."""
    if spec.preset is not None:
        from planner.models.presets import get_config
        return get_config(spec.preset, **dict(spec.overrides), seq=seq,
                          global_batch=gbs), None
    import torch
    tokens = torch.zeros(gbs, seq, dtype=torch.long, device="meta")
    return _hf_module(str(FOLDER / spec.hf_config)), (tokens, tokens)


def price(row: Row, spec: ModelSpec | None, cluster, runtimes: dict | None = None) -> Result:
    """The row under fxpar's cost model on `cluster` (a name, a profile file or a Cluster); any
    failure is the row's result, with its reason."""
    from cost_model.hardware.cluster import get_cluster
    from planner.search.meshes import Request
    if row.missing:
        return Result(row, (), reason="under-specified: the source does not print "
                                      + ", ".join(_MISSING_WORDS.get(c, c) for c in row.missing))
    try:
        fix = fix_of(row)
    except ValueError as err:
        return Result(row, (), reason=f"inconsistent row: {err}")
    if spec is None:
        return Result(row, tuple(fix.items()), reason=f"no entry for model {row.model!r} in "
                                                      f"{MODELS_FILE.name}")
    if spec.unsupported:
        return Result(row, tuple(fix.items()), reason=f"not expressible: {spec.unsupported}")
    try:
        hw = run_cluster(row, get_cluster(cluster), runtimes)
        # a step of `flushes` schedule calls: each one flush of gbs / flushes sequences
        costs, name, batch, seq = model_costs(spec, row.gbs // row.flushes, row.seq)
        best, note = _best(costs, Request(row.gpus, hw, batch, seq, float(hw.mem_bytes), name,
                                          fix, top_k=1))
    except Exception as err:  # noqa: BLE001 - a row fxpar cannot price is reported, never dropped
        return Result(row, tuple(fix.items()), reason=f"{type(err).__name__}: {_one_line(err)}")
    p, n = best.predicted, row.flushes
    return Result(row, tuple(fix.items()), p.iteration_s * n, p.compute_s * n, p.comm_s * n,
                  p.bubble_s * n, memory_note=note)


_MISSING_WORDS = {"mbs": "the micro-batch (mbs)", "seq": "the sequence length (seq)",
                  "vp": "the interleaving depth (vp)", "step_s": "a step time (step_s)",
                  "tokens_per_s_per_gpu": "tokens/s per GPU", "gbs": "the global batch (gbs)"}


def run_cluster(row: Row, hw, runtimes: dict | None = None):
    """The hardware profile `hw` under the runtime that ran the row (its fusion, overlap,
    attention kernel, launches: cost_model.hardware.runtimes; `runtimes` maps a name to the
    Runtime to use, as a fit gives), with the row's routing."""
    runtime = (runtimes or {}).get(row.runtime, row.runtime)
    return dataclasses.replace(apply(hw, runtime, row.attention),
                               round_robin_routing=row.routing == "round-robin",
                               fused_loss=row.fused_loss)


_HEADROOM = (1.1, 1.25, 1.5, 2.0, 3.0, 4.0)   # memory limits tried, x the device's
_NEEDED: dict = {}   # the least of 1 and _HEADROOM a row's request planned at


def _best(costs, request):
    """(the fastest plan, "") or, when none fits the device's memory, the fastest within the
    least of _HEADROOM x that memory that plans, and a note of what fxpar's memory model says:
    the published run did fit, so its time is still priced, and the memory model's miss is
    reported beside it."""
    from planner.api import plan_costs
    from planner.search.costs import PlanningError
    from planner.search.plan import GiB
    # memory does not depend on the runtime's speed terms: a fit's re-pricing of the row starts
    # from the headroom its first pricing needed
    key = (costs, request.gpus, request.global_batch, request.seq, request.memory_limit,
           request.cluster.name, tuple(sorted(request.fix.items())))
    factors = (1.0,) + _HEADROOM
    refusal = None
    for factor in factors[factors.index(_NEEDED.get(key, 1.0)):]:
        try:
            best = plan_costs(costs, dataclasses.replace(
                request, memory_limit=request.memory_limit * factor))[0]
            _NEEDED[key] = factor
            break
        except PlanningError as err:
            refusal = refusal or err
    else:
        raise refusal
    if _NEEDED[key] == 1.0:
        return best, ""
    from planner.bench.memory import memory_terms
    need = best.predicted.peak_memory_bytes / GiB
    return best, (f"fxpar's memory model puts this plan at {need:.1f} GiB per device "
                  f"({memory_terms(best)}), above the {request.memory_limit / GiB:.1f} GiB it "
                  f"has; the run fit: memory over-estimated")


def model_costs(spec: ModelSpec, gbs: int, seq: int):
    """The model of `spec` captured and profiled (planner.api._model_costs) for a global batch
    and sequence: captured once per sequence length (a capture takes one sequence), every batch
    and cluster a row is priced on reuses it."""
    costs, name, _, seq = _captured(spec, seq)
    return costs, name, gbs, seq


@functools.lru_cache(maxsize=None)
def _captured(spec: ModelSpec, seq: int):
    from planner.api import _model_costs
    from planner.models.loss import with_loss
    model, inputs = model_inputs(spec, 1, seq)
    return _model_costs(with_loss(model, None), inputs, 1, None)


def _one_line(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- all rows ----------------------------------------------------------------------------------

def summarize(results: list[Result] | tuple[Result, ...]) -> Summary:
    errors = [abs(r.error_pct) for r in results if r.priced]
    return Summary(len(results), len(errors),
                   statistics.median(errors) if errors else None,
                   max(errors) if errors else None,
                   sum(e <= 10 for e in errors), sum(e <= 20 for e in errors))


def rankings(results: list[Result] | tuple[Result, ...]) -> tuple[Ranking, ...]:
    """Every group of rows with the same model and GPU count that has more than one row."""
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.row.model, r.row.gpus), []).append(r)
    return tuple(_ranking(model, gpus, group) for (model, gpus), group in groups.items()
                 if len(group) > 1)


def _ranking(model: str, gpus: int, group: list[Result]) -> Ranking:
    priced = [r for r in group if r.priced]
    measured = tuple(sorted(priced, key=lambda r: -r.row.tokens_per_s_per_gpu))
    predicted = tuple(sorted(measured, key=lambda r: -r.predicted_tokens_per_s_per_gpu))
    unpriced = tuple(r for r in group if not r.priced)
    return Ranking(model, gpus, measured, predicted, unpriced, _verdict(measured, predicted))


def _verdict(measured: tuple[Result, ...], predicted: tuple[Result, ...]) -> str:
    if len(measured) < 2:
        return "fewer than two rows priced: no ranking"
    fastest, best = measured[0], predicted[0].predicted_tokens_per_s_per_gpu
    own = fastest.predicted_tokens_per_s_per_gpu
    ties = sum(r.predicted_tokens_per_s_per_gpu >= best * (1 - 1e-9) for r in predicted)
    if own >= best * (1 - 1e-9):
        return "the measured fastest is predicted fastest" + (
            f" (tied with {ties - 1} other row{'s' if ties > 2 else ''})" if ties > 1 else "")
    slower = (1 - own / best) * 100
    return (f"the measured fastest is predicted {slower:.1f}% slower than the predicted fastest: "
            + ("within 5%" if slower <= CLOSE * 100 else "not within 5%"))


def select(rows: list[Row], match: str | None) -> list[Row]:
    if not match:
        return rows
    chosen = [r for r in rows if match.lower() in r.model.lower()]
    if not chosen:
        models = ", ".join(sorted({r.model for r in rows}))
        raise ValueError(f"no published run's model contains {match!r}; models: {models}")
    return chosen


def validate(cluster=None, csvs: list[str] | None = None, match: str | None = None,
             progress: Callable[[str], None] | None = None,
             clusters: dict | None = None, runtimes: dict | None = None) -> Validation:
    """Price every published row (of `csvs`, default every CSV of the published folder; with
    `match`, the rows whose model contains it) on the cluster its file names, or on `cluster`
    for all when given. `clusters` maps a row's cluster name to the Cluster to price it on
    (planner.bench.published_fit's fitted profiles)."""
    from cost_model.hardware.cluster import get_cluster
    if cluster is not None:
        get_cluster(cluster)  # a bad cluster is an error before any row is priced
    rows = select([r for path in (csvs or csv_files()) for r in read_rows(path)], match)
    specs = load_models()
    results = []
    for i, row in enumerate(rows, 1):
        if progress:
            progress(f"[{i}/{len(rows)}] {row.model} on {row.gpus} GPUs: {row.configuration()}")
        hw = cluster if cluster is not None else (clusters or {}).get(row.cluster, row.cluster)
        results.append(price(row, specs.get(row.model), hw, runtimes))
    notes = tuple((m, specs[m].note) for m in dict.fromkeys(r.model for r in rows)
                  if m in specs and specs[m].note)
    names = sorted({get_cluster(cluster).name} if cluster is not None else
                   {r.cluster for r in rows})
    return Validation(", ".join(names), tuple(results), summarize(results), rankings(results),
                      notes)
