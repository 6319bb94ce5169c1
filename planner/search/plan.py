"""The Plan: what the planner chose and what it predicts, as a frozen value with JSON and text forms."""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from tabulate import tabulate

from passes.capture.block_runs import part_labels
from passes.stages.program import Layout
from runtime.observe.memory_tracker import CATEGORIES

GiB = 2**30
# What a rank's predicted peak holds (Predicted.rank_memory): the parts the tracker splits a
# measured one into
MEMORY_PARTS = CATEGORIES


def gib(nbytes: float, up: bool = False) -> str:
    """Bytes as GiB with the digits that matter: 2 decimals from 1 GiB, else 2 significant digits
    ("0.0017"); up=True rounds up at that precision (for an amount that must be enough)."""
    value = nbytes / GiB
    if value <= 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = 2 if value >= 1 else 1 - math.floor(math.log10(value))
    if up:
        value = math.ceil(value * 10**decimals * (1 - 1e-12)) / 10**decimals
    return f"{value:.{decimals}f}"


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[str, ...]
    strategies: tuple[str, ...]        # one per layer
    time_s: float                      # fwd + bwd of one micro-batch
    param_bytes: float                 # weights + gradients
    optimizer_bytes: float
    activation_bytes: float            # at peak (micro-batches in flight included)
    # Its parts, for simulating the whole step (planner.search.step_prediction); 0 in older plans:
    fwd_s: float = 0.0                 # forward of one micro-batch, tensor-parallel comm included
    bwd_s: float = 0.0                 # backward of one micro-batch (recompute included)
    step_s: float = 0.0                # the optimizer step over its parameters, per step
    transient_bytes: float = 0.0       # of param_bytes: the rank's temporaries ("other" of rank_memory)

    @property
    def memory_bytes(self) -> float:
        return self.param_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def weight_grad_bytes(self) -> float:
        """Weights and gradients alone (param_bytes holds the rank's temporaries too)."""
        return self.param_bytes - self.transient_bytes


@dataclass(frozen=True)
class Predicted:
    iteration_s: float
    compute_s: float
    comm_s: float                      # exposed communication: TP collectives, p2p, DP sync
    bubble_s: float
    bubble_fraction: float
    peak_memory_bytes: float
    tokens_per_s: float
    tflops_per_gpu: float
    p2p_s: float = 0.0                 # one message between neighbouring stages
    rank_sync_s: tuple[float, ...] = ()  # per pipeline rank: exposed data-parallel sync
    runtime_s: float = 0.0             # the optimizer step and the runtime's own time
    # per pipeline rank, its peak's parts in bytes: MEMORY_PARTS (planner.search.solved)
    rank_memory: tuple[tuple[float, ...], ...] = ()
    # of peak_memory_bytes, what is not live tensors: CUDA context, workspaces, NCCL buffers,
    # the allocator's reserve (cost_model.hardware.device_memory)
    device_bytes: float = 0.0


@dataclass(frozen=True)
class Plan:
    model: str
    gpus: int
    cluster: str
    dp: int
    tp: int
    pp: int
    micro_batch: int
    num_microbatches: int
    global_batch: int
    seq: int
    schedule: str
    memory_limit_bytes: float
    stages: tuple[StagePlan, ...]
    predicted: Predicted
    notes: tuple[str, ...] = ()
    solver: str = ""                   # "optimal, gap 0.00%" or "feasible, gap 3.10%"
    virtual_stages: int = 1            # stages per rank (interleaved schedules)
    cp: int = 1                        # context-parallel ranks sharing a sequence
    # What varies from run to run (solve_s: seconds of the plan's ILP, search_s: of the whole
    # search); equality, --diff and the JSON without timing leave it out.
    timing: dict = field(default_factory=dict, compare=False)
    ep: int = 1                        # expert-parallel ranks (carved from dp x cp) per MoE layer
    zero: int = 0                      # sharded data parallel level 0-3 (runtime.data_parallel.sharded_dp)
    dp_shard: int | None = None        # dp ranks per shard group (hybrid sharding); None: all
    params: int = 0                    # the model's parameters (all of them, unsharded)
    sizes_from: str = ""               # where seq and global batch came from
    sequences: bool = True             # False: inputs are not sequences (rates in samples/s)
    runtime: str = ""                  # the runtime profile priced (cost_model.hardware.runtimes)
    # ZB-H1's split backward (runtime.pipeline.split_backward): "record" (W starts from the
    # gradients I recorded), or "" for the runtime's default, W walking the graph again
    split_backward: str = ""
    # the runtime's autocast the activations were priced under ("bf16", "fp16"), "" for none
    autocast: str = ""

    def layout(self) -> Layout:
        # "vocab-tp" is the vocabulary-parallel rewrite of an end layer ("tp" to the passes); it
        # is priced with padding allowed (a no-op when tp divides the vocabulary).
        strategies = tuple((layer, "tp" if s == "vocab-tp" else s) for st in self.stages
                           for layer, s in zip(st.layers, st.strategies) if s != "none")
        vocab = any(s == "vocab-tp" for st in self.stages for s in st.strategies)
        return Layout(self.tp, strategies, tuple(len(st.layers) for st in self.stages),
                      pad_vocab=vocab, cp=self.cp, ep=self.ep)

    def parts(self) -> tuple[str, ...]:
        """The lists of blocks the plan splits, in model order ("blocks"; a vision-language
        model's vision tower's and decoder's): what the runtime captures as blocks."""
        return tuple(dict.fromkeys(prefix for st in self.stages
                                   for prefix, _ in _block_groups(st.layers)))

    def with_ends(self, strategy: str, ends: tuple[str, ...] = ("embed", "head")) -> "Plan":
        """The plan with the end layers named `ends` given `strategy` ("vocab-tp": what a GPU
        cluster's prices choose where this one's would not), everything else as it is."""
        stages = tuple(replace(st, strategies=tuple(strategy if layer in ends else s for layer, s
                                                    in zip(st.layers, st.strategies)))
                       for st in self.stages)
        return replace(self, stages=stages)

    def _zero_text(self) -> str:
        """The sharded-data-parallel level in the mesh line (nothing for level 0)."""
        if self.zero == 0:
            return ""
        hybrid = (f", shard {self.dp_shard} x replicate {self.dp // self.dp_shard}"
                  if self.dp_shard and self.dp_shard != self.dp else "")
        return f"   zero={self.zero}{hybrid}"

    def to_json(self, timing: bool = True) -> dict:
        """The plan as JSON data; "timing" comes last and only with timing=True: the rest is the
        same for the same request, byte for byte."""
        data = asdict(self)
        del data["timing"]
        if self.ep == 1:  # plans without expert parallelism read as they always have
            del data["ep"]
        if self.zero == 0 and self.dp_shard is None:  # likewise without sharded dp
            del data["zero"], data["dp_shard"]
        data["mesh"] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp}
        if self.ep > 1:
            data["mesh"]["ep"] = self.ep
        if timing:
            data["timing"] = dict(self.timing)
        return data

    def dumps(self, timing: bool = True) -> str:
        return json.dumps(self.to_json(timing), indent=2)

    @staticmethod
    def from_json(data: dict | str) -> "Plan":
        """A plan from to_json's data (or its text); ValueError naming what is wrong otherwise."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k != "mesh"}
        _check_fields(Plan, data, "plan")
        stages, predicted = data["stages"], data["predicted"]
        if not isinstance(stages, (list, tuple)) or not isinstance(predicted, dict):
            raise ValueError("'stages' must be a list and 'predicted' an object")
        for i, s in enumerate(data["stages"]):
            if not isinstance(s, dict):
                raise ValueError(f"stage {i} is not an object")
            _check_fields(StagePlan, s, f"stage {i}")
        _check_fields(Predicted, data["predicted"], "'predicted'")
        stages = tuple(StagePlan(**{**s, "layers": tuple(s["layers"]),
                                    "strategies": tuple(s["strategies"])})
                       for s in data.pop("stages"))
        status, _, seconds = data.get("solver", "").rpartition(", ")
        if status and seconds.endswith(" s"):  # written before timing had its own key
            data["solver"] = status
            data.setdefault("timing", {"solve_s": float(seconds.removesuffix(" s"))})
        return Plan(**{**data, "stages": stages, "predicted": _predicted(data.pop("predicted")),
                       "notes": tuple(data.pop("notes", ())),
                       "timing": dict(data.get("timing") or {})})

    def _rate(self) -> str:
        if self.sequences:
            return f"{self.predicted.tokens_per_s:,.0f} tokens/s"
        return f"{self.predicted.tokens_per_s / max(self.seq, 1):,.1f} samples/s"

    def __str__(self) -> str:
        p = self.predicted
        head = [
            f"fxpar plan: {self.model} on {self.gpus} GPUs ({self.cluster}"
            f"{f', {self.runtime} runtime' if self.runtime else ''})",
            f"mesh dp={self.dp} x tp={self.tp} x pp={self.pp}"
            f"{f' x cp={self.cp}' if self.cp > 1 else ''}"
            f"{f' (ep={self.ep} of dp x cp)' if self.ep > 1 else ''}{self._zero_text()}"
            f"   schedule {self.schedule}"
            f"{f' (v={self.virtual_stages} stages per rank)' if self.virtual_stages > 1 else ''}"
            f"{' (split backward: record)' if self.split_backward == 'record' else ''}   "
            f"global batch {self.global_batch} = dp {self.dp} x "
            f"{plural(self.num_microbatches, 'micro-batch')} x {self.micro_batch}"
            f"{f'   seq {self.seq}' if self.sequences else ''}",
        ]
        if self.params or self.sizes_from or self.autocast:
            head.append("   ".join(filter(None, (
                f"model {_count(self.params)} parameters" if self.params else "",
                self.sizes_from,
                f"autocast {self.autocast} over fp32 weights" if self.autocast else ""))))
        unit, scale = ("GiB", GiB) if p.peak_memory_bytes >= GiB else ("MiB", 2**20)
        labels = part_labels(prefix for st in self.stages for prefix, _ in
                             _block_groups(st.layers))
        rows = [[f"{s} (rank {s % self.pp})" if self.virtual_stages > 1 else s,
                 _span(st.layers, labels), _strategies(st.strategies), f"{st.time_s * 1e3:.2f}",
                 *(_size(b, scale) for b in (st.weight_grad_bytes, st.optimizer_bytes,
                                             st.activation_bytes, st.transient_bytes,
                                             st.memory_bytes))]
                for s, st in enumerate(self.stages)]
        table = tabulate(rows, headers=["stage", "layers", "strategy", "ms/micro-batch",
                                        f"params+grads {unit}", f"optimizer {unit}",
                                        f"activations {unit}", f"other {unit}",
                                        f"memory/device {unit}"],
                         tablefmt="simple", disable_numparse=True)
        if len(labels) > 1:
            table += "\n" + self._parts_table(labels)
        tail = [
            f"predicted iteration {p.iteration_s:.4g} s = compute {p.compute_s:.4g} + exposed "
            f"comm {p.comm_s:.4g} + bubble {p.bubble_s:.4g}"
            f"{f' + optimizer and runtime {p.runtime_s:.4g}' if p.runtime_s else ''}"
            f"   bubble fraction "
            f"{max(p.bubble_fraction, 0.0):.3f}{_over_compute(p.bubble_fraction)}",
            f"peak memory/device {_size(p.peak_memory_bytes, scale)} {unit} of "
            f"{_size(self.memory_limit_bytes, scale)} {unit}   {self._rate()}   "
            f"{p.tflops_per_gpu:.1f} model TFLOP/s per GPU",
        ]
        if p.device_bytes:
            tail.append(f"   of which {_size(p.device_bytes, scale)} {unit} not tensors: CUDA "
                        f"context, workspaces, NCCL buffers, allocator reserve")
        if self.solver:
            seconds = self.timing.get("solve_s")
            tail.append(f"solver: {self.solver}"
                        + (f", {seconds:.2f} s" if seconds is not None else ""))
        tail += [f"note: {n}" for n in self.notes]
        return "\n".join(head + [table] + tail)


    def _parts_table(self, labels: dict[str, str]) -> str:
        """Each part's plan: its blocks, the stages that hold them, their strategies (tp: split
        over the tp group; none: whole on each of its ranks)."""
        rows = []
        for prefix, label in labels.items():
            stages, strategies, count = [], [], 0
            for s, st in enumerate(self.stages):
                mine = [(layer, how) for layer, how in zip(st.layers, st.strategies)
                        if layer.rpartition(".")[0] == prefix]
                if mine:
                    stages.append(s)
                    strategies += [how for _, how in mine]
                    count += len(mine)
            where = (f"{stages[0]}" if stages[0] == stages[-1] else f"{stages[0]}-{stages[-1]}")
            split = sum("tp" in how.split("+") for how in strategies)
            tp = (f"tp={self.tp}" if split == count else "whole" if not split
                  else f"tp={self.tp} on {split} of {count}") if self.tp > 1 else "-"
            rows.append([label, count, where, tp, _strategies(tuple(strategies))])
        return tabulate(rows, headers=["part", "blocks", "stages", "tensor parallel",
                                       "strategies"], tablefmt="simple", disable_numparse=True)


def _over_compute(fraction: float) -> str:
    """The bubble fraction is idle time over compute time, (p - 1)/m under 1F1B as the
    literature defines it: said so where it reaches 1 and could be read as a share."""
    if fraction < 1:
        return ""
    return " (idle over compute time: more micro-batches per step shrink it)"


def plural(n: int, word: str) -> str:
    """'1 stage', '2 stages', '1 micro-batch', '2 micro-batches'."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def _count(n: int) -> str:
    """7.62B, 124M, 36.1K: a parameter count in three digits."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _predicted(data: dict) -> Predicted:
    return Predicted(**{**data, "rank_sync_s": tuple(data.get("rank_sync_s", ())),
                        "rank_memory": tuple(tuple(r) for r in data.get("rank_memory", ()))})


def _check_fields(cls, data: dict, what: str) -> None:
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING}
    missing, unknown = sorted(required - set(data)), sorted(set(data) - names)
    if missing or unknown:
        raise ValueError(f"{what}: " + "; ".join(
            f"{label} {_names(keys)}" for label, keys in (("missing", missing),
                                                         ("unknown", unknown)) if keys))


def _names(keys: list[str], most: int = 5) -> str:
    shown = ", ".join(map(repr, keys[:most]))
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _size(nbytes: float, scale: float) -> str:
    value = nbytes / scale
    return f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def _span(layers: tuple[str, ...], labels: dict[str, str] | None = None) -> str:
    """'embed + blocks 0-3', or with parts 'embed + vision_tower 0-23 + language_model 0-3'."""
    labels = labels or {}
    parts = ["embed"] if "embed" in layers else []
    for prefix, numbers in _block_groups(layers):
        label = labels.get(prefix, "blocks")
        first, last = numbers[0], numbers[-1]
        if label == "blocks":
            parts.append(f"blocks {first}-{last}" if first != last else f"block {first}")
        else:
            parts.append(f"{label} {first}-{last}" if first != last else f"{label} {first}")
    if "head" in layers:
        parts.append("head")
    return " + ".join(parts)


def _block_groups(layers) -> list[tuple[str, list[str]]]:
    """Consecutive blocks of one list: [(list name, [block numbers])]."""
    groups: list[tuple[str, list[str]]] = []
    for layer in layers:
        if layer in ("embed", "head"):
            continue
        prefix, _, number = layer.rpartition(".")
        if groups and groups[-1][0] == prefix:
            groups[-1][1].append(number)
        else:
            groups.append((prefix, [number]))
    return groups



def _strategies(strategies: tuple[str, ...]) -> str:
    """Run-length text: 'none, tp x 5'."""
    runs: list[list] = []
    for s in strategies:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return ", ".join(f"{s} x{c}" if c > 1 else s for s, c in runs)
