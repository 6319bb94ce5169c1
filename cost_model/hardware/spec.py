"""The `Cluster` spec: per-device hardware numbers (and, once a runtime profile is applied, what
the framework does with them), each field's rule, and the JSON form of a profile. The presets are
cost_model.hardware.presets; profiles on disk and lookup by name are cost_model.hardware.cluster.

Every number is per device (one GPU, or one rank process on CPU) so that the
cost model never has to know how many devices share a node's resources,
except through `gpus_per_node`, which decides whether a communication group
stays on the fast intra-node links.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from runtime.comm.wire import KINDS

__all__ = ["CALIBRATE_HINT", "Cluster", "PER_ELEMENT_RULES", "ProfileError", "RUNTIME_FIELDS"]

CALIBRATE_HINT = "fxpar calibrate --out FILE"


class ProfileError(ValueError):
    """A cluster profile file is missing, unreadable or malformed."""


# Field rules: (kind, lower bound, upper bound, lower bound inclusive?).
# "pos" fields divide something, so zero is as wrong as negative.
_POSITIVE = ("float", 0.0, math.inf, False)
_NONNEG = ("float", 0.0, math.inf, True)
_FRACTION = ("float", 0.0, 1.0, False)  # an efficiency of 0 would mean "never finishes"
_SHARE = ("float", 0.0, 1.0, True)  # an overlap share may legitimately be 0

# Ops priced per element where a profile measured them (OpCost.per_element; Cluster.element_s)
PER_ELEMENT_RULES = ("layer_norm", "rms_norm", "strided")

_RULES: dict[str, tuple] = {
    "name": ("str",),
    "gpu_arch": ("choice", "", "hopper", "ampere"),
    "runtime": ("label",),
    "tp_overlap": ("choice", "none", "backward", "pipelined"),
    "host_op_s": _NONNEG,
    "optimizer_bytes": _NONNEG,
    "device": ("device",),
    "gpus_per_node": ("int",),
    "peak_flops": _POSITIVE,
    "mem_bytes": _POSITIVE,
    "mem_bw": _POSITIVE,
    "intra_bw": _POSITIVE,
    "inter_bw": _POSITIVE,
    "intra_latency": _NONNEG,
    "inter_latency": _NONNEG,
    "matmul_eff": _FRACTION,
    "attention_eff": _FRACTION,
    "grouped_gemm_eff": _FRACTION,
    "bw_eff": _FRACTION,
    "kernel_floor": _NONNEG,
    "comm_eff": _FRACTION,
    "dp_overlap": _SHARE,
    "nic_per_gpu": ("bool",),
    "comm_stream": ("bool",),
    "sms": _NONNEG,
    "comm_sm_share": _SHARE,
    "fused_pointwise": ("bool",),
    "dispatch_per_rank": ("bool",),
    "shards_experts": ("bool",),
    "fused_loss": ("bool",),
    "round_robin_routing": ("bool",),
    "comm_corrections": ("corrections",),
    "matmul_overhead": _NONNEG,
    "pointwise_flops": _NONNEG,
    "attention_overhead": _NONNEG,
    "forward_floor": _NONNEG,
    "backward_floor": _NONNEG,
    **{f"{rule}_{side}": _NONNEG for rule in PER_ELEMENT_RULES for side in ("fwd", "bwd")},
    "op_overhead": _NONNEG,
    "action_floor": _NONNEG,
    "action_overhead": _NONNEG,
    "step_overhead": _NONNEG,
    "split_backward": _NONNEG,
    "optimizer_per_param": _NONNEG,
    "optimizer_per_tensor": _NONNEG,
    "cores": _NONNEG,
    "unshared_ranks": _NONNEG,
    "collective_handoff": _NONNEG,
    "sync_handoff": _NONNEG,
    "sync_latency": _NONNEG,
    "send_overhead": _NONNEG,
    "recv_overhead": _NONNEG,
    "p2p_handoff": _NONNEG,
    "shared_send_wait": _NONNEG,
    "shared_p2p_handoff": _NONNEG,
    "ring_step_fwd": _NONNEG,
    "ring_step_bwd": _NONNEG,
}

# The runtime's own time and shared cores (planner.bench.runtime_probes measures them): any of them
# non-zero makes plans simulate the whole step (Cluster.runtime_priced).
RUNTIME_FIELDS = ("action_floor", "action_overhead", "step_overhead", "split_backward",
                  "optimizer_per_param", "optimizer_per_tensor", "cores", "collective_handoff",
                  "sync_handoff", "sync_latency", "send_overhead", "recv_overhead", "p2p_handoff",
                  "shared_send_wait", "shared_p2p_handoff", "ring_step_fwd", "ring_step_bwd")

_DEVICES = ("cuda", "cpu")

# Collective kinds the cost model prices (re-exported as comm.KINDS); each may
# carry a measured correction in `comm_corrections`.
COMM_KINDS = KINDS  # the collective kinds (runtime.comm.wire), keying the per-kind fields
# The neutral correction: the textbook ring formula as it stands.
NEUTRAL = (1.0, 1.0)


def _field_problem(field: str, value: Any) -> str | None:
    """Why `value` is not acceptable for `field`, or None when it is."""
    kind = _RULES[field][0]
    if kind == "str":
        if not isinstance(value, str) or not value:
            return f"must be a non-empty string, got {value!r}"
        return None
    if kind == "label":
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    if kind == "choice":
        options = _RULES[field][1:]
        return None if value in options else f"must be one of {list(options)}, got {value!r}"
    if kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if kind == "device":
        if value not in _DEVICES:
            return f"must be one of {list(_DEVICES)}, got {value!r}"
        return None
    # bool is an int subclass; `true` in a profile is a typo, not a number.
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"must be an integer >= 1, got {value!r}"
        return None
    if kind == "corrections":
        return _corrections_problem(value)
    return _number_problem(value, _RULES[field])


def _number_problem(value: Any, rule: tuple) -> str | None:
    _, lo, hi, lo_inclusive = rule
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {type(value).__name__} {value!r}"
    if not math.isfinite(value):
        return f"must be finite, got {value!r}"
    if value < lo or (value == lo and not lo_inclusive):
        return f"must be {'>=' if lo_inclusive else '>'} {lo:g}, got {value!r}"
    if value > hi:
        return f"must be <= {hi:g}, got {value!r}"
    return None


@dataclass(frozen=True)
class Cluster:
    """Per-device hardware numbers and achieved efficiencies; all SI units."""

    name: str
    device: str  # "cuda" or "cpu"
    gpus_per_node: int
    peak_flops: float  # dense bf16 FLOP/s per device (fp32 for cpu)
    mem_bytes: float  # memory per device
    mem_bw: float  # device memory bandwidth, bytes/s
    intra_bw: float  # per-device one-direction bandwidth inside a node, bytes/s
    inter_bw: float  # per-device one-direction bandwidth between nodes, bytes/s
    intra_latency: float  # alpha, seconds per ring step inside a node
    inter_latency: float  # alpha, seconds per ring step across nodes
    matmul_eff: float  # achieved fraction of peak_flops for large matmuls
    attention_eff: float  # achieved fraction for attention kernels
    bw_eff: float  # achieved fraction of mem_bw for memory-bound kernels
    kernel_floor: float  # seconds: the least time any kernel takes
    comm_eff: float  # achieved fraction of nominal link bandwidth
    dp_overlap: float  # fraction of the DP all-reduce hidden behind backward
    # Per-kind (latency, bandwidth) multipliers of the ring formula's alpha and
    # bw, measured by calibration because a library implements each kind its
    # own way (see comm.py). Given as {kind: (latency, bandwidth)} and stored
    # as sorted (kind, latency, bandwidth) triples so that a Cluster stays
    # hashable; a kind left out is neutral (1, 1), i.e. textbook.
    comm_corrections: Any = ()
    # One network NIC per GPU, as on rail-optimised nodes (DGX A100/H100/H200: 8 GPUs, 8 compute
    # NICs): a ring with k members in a node crosses the network on k NICs at once
    # (cost_model.hardware.comm). False: the node's ranks share one link (CPU ranks, loopback).
    nic_per_gpu: bool = False
    # Collectives run on a stream of their own beside compute (GPUs: NCCL kernels on their own
    # SMs), so the data-parallel ones are scheduled beside the compute they overlap
    # (cost_model.layers.sharding); False: a share dp_overlap of them is hidden (CPU ranks).
    comm_stream: bool = False
    # Streaming multiprocessors of the GPU (datasheet), for a GEMM's tile and wave quantisation
    # (cost_model.hardware.compute.gemm_efficiency); 0: not modelled (CPU).
    sms: float = 0
    # The share of the GPU a collective's kernels hold while they run beside compute (NCCL runs
    # one thread block per channel, each on an SM of its own): compute beside them slows by it.
    # 0: none (CPU ranks, where dp_overlap is measured instead).
    comm_sm_share: float = 0.0
    # Chains of pointwise ops (activations, norms, casts, residual adds) run as one kernel each,
    # as torch.compile and Transformer Engine's fused kernels run them: only the tensors entering
    # and leaving a chain move through memory (cost_model.layers.fusion). False: one kernel per
    # op, as eager PyTorch (and fxpar's runtime) runs them.
    fused_pointwise: bool = False
    # The share of matmul_eff a grouped GEMM (a mixture-of-experts layer's experts, one GEMM per
    # expert in one kernel: cutlass / Transformer Engine grouped GEMMs) keeps beside one dense
    # cuBLAS GEMM of the same shape share: fitted per profile on published MoE runs; 1 in
    # presets without such a fit.
    grouped_gemm_eff: float = 1.0
    # The expert dispatch sends a token once to each GPU that holds any of its experts, and once
    # across the network to each other node (DeepEP's kernels), not once per routed slot (an
    # all-to-all of permuted slots, as fxpar's runtime and Megatron's all-to-all dispatcher
    # run it): cost_model.hardware.comm.dispatch_fanout. A property of the kernels a run used.
    dispatch_per_rank: bool = False
    # Expert weights' states sharded as the runtime shards the rest, over the ranks that hold the
    # same experts (runtimes.Runtime.shards_experts); False: whole on each of them, as fxpar's
    # runtime keeps them (runtime.training.trainer).
    shards_experts: bool = False
    # The cross-entropy is one kernel that keeps the logits and a value per row and writes the
    # logits' gradient in its backward (flash-attn's CrossEntropyLoss, llm-foundry's default
    # loss_fn "fused_crossentropy"; Megatron's --cross-entropy-loss-fusion): no log-probabilities
    # and no gradient of them beside it (cost_model.layers.layer_cost._temporary). A property of
    # the run's loss, for pricing published runs; fxpar's runtime runs torch's cross-entropy.
    fused_loss: bool = False
    # Tokens routed round-robin over consecutive experts with equal loads (the fake balanced
    # gate throughput benchmarks run, NeMo AutoModel's FakeBalancedGate), not by a trained
    # router: a property of the run, for pricing published benchmarks (dispatch_fanout).
    round_robin_routing: bool = False
    # Seconds each priced matmul (a layer's forward, or its backward) takes on
    # top of flops / (peak_flops * matmul_eff): small GEMMs reach a lower rate
    # than large ones (CPU BLAS packing and blocking), which one efficiency
    # cannot express. Calibration fits it with matmul_eff; 0 keeps the plain
    # roofline, as in the presets.
    matmul_overhead: float = 0.0
    # FLOP/s at which pointwise ops (activations, exp, their backward) run the FLOPs their rules
    # count: a CPU evaluates erf or exp far below its matmul rate, which left a small model's
    # GELU priced at a twentieth of its time. 0: the matmul rate, as in the presets.
    pointwise_flops: float = 0.0
    # Seconds fused attention takes per (batch x head) pair beyond its FLOPs (per forward;
    # backward counts SDPA_BWD_FACTOR of it): a CPU kernel's per-pair set-up, which dominates
    # small heads (head_dim 8: 8x the FLOP-priced time). 0 in the presets.
    attention_overhead: float = 0.0
    # The least seconds of an op in a training step: recorded by autograd in the forward, run
    # as an autograd node in the backward (more than a bare kernel's kernel_floor on CPU).
    # 0: kernel_floor, as in the presets.
    forward_floor: float = 0.0
    backward_floor: float = 0.0
    # Seconds per element, forward and backward, of ops a CPU runs element by element far from
    # what their FLOPs and bytes say (OpCost.per_element): LayerNorm and RMSNorm (whose CPU
    # backward runs about 6x its forward, decomposed), and pointwise ops and copies over a
    # non-contiguous tensor (3-4x slower than over a contiguous one). Each is the least time
    # of such an op; 0 (the presets): not measured, the roofline alone.
    layer_norm_fwd: float = 0.0
    layer_norm_bwd: float = 0.0
    rms_norm_fwd: float = 0.0
    rms_norm_bwd: float = 0.0
    strided_fwd: float = 0.0
    strided_bwd: float = 0.0
    # The runtime's own time, which op costs leave out (Python, autograd's set-up), measured by
    # calibration on a one-rank training run (planner.bench.runtime_probes); 0 in the presets, where
    # a GPU runs kernels while the host prepares the next ones.
    op_overhead: float = 0.0       # seconds per op of a layer's graph per pass (F or B), beyond
    #                                its priced kernel: Python, dispatch, autograd's node, views
    action_floor: float = 0.0      # seconds added to every pipeline compute action (F, B, I, W)
    action_overhead: float = 0.0   # seconds per compute action between actions (bookkeeping)
    step_overhead: float = 0.0     # seconds per training step outside the schedule
    split_backward: float = 0.0    # I + W take (1 + this) x B's compute: a second traversal
    optimizer_per_param: float = 0.0   # seconds of the optimizer step per parameter
    optimizer_per_tensor: float = 0.0  # and per parameter tensor
    collective_handoff: float = 0.0  # seconds a collective takes in a step beyond back to back
    # and what each of the step's own collectives (its opening check, the data-parallel sync,
    # the loss's all-reduce) takes beyond that: their groups idled through a stage's computing
    # (with sync_latency calibrated, the data-parallel sync's alone), and the first all-reduce of
    # each action of a tensor-parallel stage, beyond its collective_handoff
    sync_handoff: float = 0.0
    # Seconds per ring step of those small all-reduces as a step reaches them, wake-up included
    # (measured on each calibrated world size); 0: priced by the links, plus sync_handoff
    sync_latency: float = 0.0
    send_overhead: float = 0.0     # seconds the sender spends posting a pipeline message
    # CPU seconds a received pipeline message costs its rank: posting the receive, taking the
    # message, and gloo's own thread moving it (both ends'), all outside the actions
    recv_overhead: float = 0.0
    p2p_handoff: float = 0.0       # seconds from one stage's action to the next stage's, through
    #                                a message the receiver waited for (post, wire, wake-up)
    # The same for a post made while more ranks want CPU than run unshared on the cores
    # (runtime.pipeline.step_sim counts them at the post): it then also waits for the core the receiver it
    # wakes takes from the sender (no CPU of its own), and the hand-off is as measured with every
    # core busy. 0: as on idle cores.
    shared_send_wait: float = 0.0
    shared_p2p_handoff: float = 0.0
    # Seconds each step of ring attention (one K/V block, cp per attention and pass) takes in a
    # forward or backward beyond its priced ops and messages: the Python between blocks, gloo's
    # batched post and wake-up, waiting for the peer's block (planner.bench.ring_probe). 0: none.
    ring_step_fwd: float = 0.0
    ring_step_bwd: float = 0.0
    # Cores the ranks of one node share (CPU ranks; calibration measures how N busy ranks slow
    # each other down); 0: every rank has a device of its own.
    cores: float = 0.0
    # Busy ranks that run at full speed together (measured: no slowdown); more than that share
    # `cores`. 0: they share `cores` from the second one on.
    unshared_ranks: float = 0.0

    # ---- set by a runtime profile (cost_model.hardware.runtimes.apply); neutral in the presets
    # The GPU generation, which decides the attention kernels' rates (runtimes.ATTENTION_SHARE)
    gpu_arch: str = ""
    runtime: str = ""              # the runtime profile applied ("": none, the hardware alone)
    # How tensor-parallel collectives meet their layer's GEMMs (runtimes.TP_OVERLAPS): "none"
    # exposes them, "backward" hides the backward's behind the weight-gradient GEMMs,
    # "pipelined" hides all but one tp-th chunk of each pass's behind that pass's GEMMs
    tp_overlap: str = "none"
    # Host seconds to launch one kernel: a layer's pass takes at least its launches
    host_op_s: float = 0.0
    # Bytes the optimizer step reads and writes per parameter it holds (priced at mem_bw)
    optimizer_bytes: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.comm_corrections, dict):
            # Frozen dataclass: normalise through object.__setattr__.
            object.__setattr__(self, "comm_corrections", _corrections_tuple(self.comm_corrections))
        for f in dataclasses.fields(self):
            problem = _field_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"Cluster field '{f.name}' {problem}")

    @property
    def runtime_priced(self) -> bool:
        """Whether plans on this cluster price the runtime's own time and shared cores, by
        simulating the whole step (planner.search.step_prediction)."""
        return any(getattr(self, name) for name in RUNTIME_FIELDS)

    def element_s(self, rule: str, backward: bool) -> float:
        """Measured seconds per element of a per-element op (OpCost.per_element), 0 for
        none."""
        return getattr(self, f"{rule}_{'bwd' if backward else 'fwd'}") if rule else 0.0

    def comm_correction(self, kind: str) -> tuple[float, float]:
        """(latency, bandwidth) multipliers for `kind`; (1, 1) when not measured."""
        return next(((lat, bw) for k, lat, bw in self.comm_corrections if k == kind), NEUTRAL)

    def to_json(self) -> dict:
        """A plain dict that `from_json` accepts and `json.dump` can write."""
        data = dataclasses.asdict(self)
        data["comm_corrections"] = {
            kind: {"latency": lat, "bandwidth": bw} for kind, lat, bw in self.comm_corrections}
        return data

    @staticmethod
    def from_json(d: dict, source: str = "<dict>") -> "Cluster":
        """Build from a profile dict; any problem raises ProfileError naming
        `source` and the offending field."""
        command = CALIBRATE_HINT if source == "<dict>" else CALIBRATE_HINT.replace("FILE", source)
        fix = f"fix the field or regenerate the profile with `{command}`"
        if not isinstance(d, dict):
            raise ProfileError(
                f"{source}: a cluster profile must be a JSON object, "
                f"got {type(d).__name__}; {fix}"
            )
        names = [f.name for f in dataclasses.fields(Cluster)]
        d = _with_json_corrections(d, source, fix)
        # Unknown keys are rejected so that a misspelt field cannot silently
        # fall back to nothing and leave the intended value unused.
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ProfileError(
                f"{source}: unknown field(s) {unknown}; the known fields are "
                f"{names}; remove or rename them"
            )
        for name in names:
            if name not in d and name in _OPTIONAL:
                continue  # profiles written before the field existed keep loading
            if name not in d:
                raise ProfileError(f"{source}: missing field '{name}'; {fix}")
            problem = _field_problem(name, d[name])
            if problem:
                raise ProfileError(f"{source}: field '{name}' {problem}; {fix}")
        return Cluster(**{n: d[n] for n in names if n in d})


# Fields a profile may leave out: those with a neutral default in Cluster (profiles written
# before a field existed keep loading).
_OPTIONAL = frozenset(f.name for f in dataclasses.fields(Cluster)
                      if f.default is not dataclasses.MISSING)


def _corrections_tuple(mapping: dict) -> tuple:
    """{kind: (latency, bandwidth)} -> sorted (kind, latency, bandwidth) triples."""
    return tuple(sorted((kind, *pair) for kind, pair in mapping.items()))


def _corrections_problem(value: Any) -> str | None:
    """Why a comm_corrections tuple is not acceptable, or None."""
    if not isinstance(value, tuple):
        return f"must be a mapping of kind to (latency, bandwidth), got {value!r}"
    for entry in value:
        if not (isinstance(entry, tuple) and len(entry) == 3):
            return f"entries must be (kind, latency, bandwidth), got {entry!r}"
        kind, *factors = entry
        if kind not in COMM_KINDS:
            return f"has unknown kind {kind!r}; expected some of {list(COMM_KINDS)}"
        for label, factor in zip(("latency", "bandwidth"), factors):
            problem = _number_problem(factor, _POSITIVE)
            if problem:
                return f"{kind}.{label} {problem}"
    return None


def _with_json_corrections(d: Any, source: str, fix: str) -> Any:
    """`d` with its JSON comm_corrections ({kind: {"latency", "bandwidth"}})
    turned into the tuple form the dataclass validates; shape errors here name
    the nested field, value errors are left to the common field check."""
    if not isinstance(d, dict) or "comm_corrections" not in d:
        return d
    raw, where = d["comm_corrections"], f"{source}: field 'comm_corrections'"
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be an object of kind -> "
                           f"{{latency, bandwidth}}, got {raw!r}; {fix}")
    pairs = {}
    for kind, entry in raw.items():
        if not isinstance(entry, dict) or set(entry) != {"latency", "bandwidth"}:
            raise ProfileError(f"{where}: '{kind}' must be an object with exactly the keys "
                               f"'latency' and 'bandwidth', got {entry!r}; {fix}")
        pairs[kind] = (entry["latency"], entry["bandwidth"])
    return {**d, "comm_corrections": _corrections_tuple(pairs)}
