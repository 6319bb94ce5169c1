"""What a training framework does with the hardware: runtime profiles.

A hardware profile (cost_model.hardware.presets) says what the device and the network
do, each number from a datasheet or a public microbenchmark. A training framework decides how
much of it a step gets: which communication hides behind which compute, which pointwise chains
run as one kernel, which attention kernel runs, how long the host takes to launch each kernel,
what the optimizer step moves. A `Runtime` names those terms; `apply` puts one on a hardware
profile and gives the `Cluster` every price is computed on.

    term             what it is (the Cluster field it sets)
    fused_pointwise  pointwise chains (norms, activations, residual adds, casts) run as one
                     kernel: Transformer Engine's fused kernels, torch.compile (fused_pointwise)
    attention        the attention kernel the framework calls; its rate on the device is the
                     hardware's best fused-attention rate times the kernel's share on that GPU
                     generation (ATTENTION_SHARE) (attention_eff)
    tp_overlap       how tensor-parallel collectives meet the GEMMs of their layer (tp_overlap):
                     "none" (each collective waits: fxpar's runtime, plain PyTorch),
                     "backward" (Megatron-Core's default: the input gradient's all-reduce runs
                     while the weight-gradient GEMM computes), "pipelined" (Transformer Engine's
                     userbuffers, `--tp-comm-overlap`: every collective is cut into tp chunks, each
                     hidden behind the GEMM of the previous chunk; one chunk stays exposed)
    dp_stream        data-parallel collectives (DDP buckets, ZeRO/FSDP all-gathers and
                     reduce-scatters, Megatron's distributed optimizer) run on a stream of their
                     own beside backward and forward, prefetched (comm_stream)
    dispatch         the expert dispatch sends a token once per GPU and node (DeepEP) or once per
                     routed slot (an all-to-all of permuted tokens) (dispatch_per_rank)
    shards_experts   expert weights' states are sharded as the rest are, over the expert-data-
                     parallel group (the data-parallel ranks holding the same experts):
                     Megatron-Core's distributed optimizer over its expert-data-parallel group,
                     FSDP2's fully_shard of the experts over the data-parallel ranks left
                     beside ep (torchtitan, NeMo AutoModel); fxpar's runtime keeps them whole
                     (shards_experts)
    optimizer_bytes  bytes the optimizer step reads and writes per parameter it holds, from the
                     precision policy: Adam over fp32 main weights, m and v (4 + 4 + 4 read and
                     written) with an fp32 gradient read and a bf16 copy written: 30 (Megatron's
                     distributed optimizer); FSDP's fp32 sharded parameters: 28 (optimizer_bytes)
    host_op_s        seconds the host takes to launch one kernel (eager dispatch, autograd's
                     node, the framework's hooks): a pass of a layer takes at least its kernels'
                     launches, which is what small models run into (host_op_s). Fitted.
    compute_share    the share of the microbenchmarked tensor-core rates (GEMMs, attention)
                     reached inside a training step: clocks under sustained power draw, the
                     SMs and memory traffic of overlapped collectives. Fitted; 1 = the
                     microbenchmark's rate.

At most the two fitted terms (FITTED) are set from published runs
(planner.bench.published_fit); the rest are what the framework is documented to do.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ATTENTION_SHARE", "FITTED", "RUNTIMES", "Runtime", "apply", "get_runtime"]

TP_OVERLAPS = ("none", "backward", "pipelined")
FITTED = ("compute_share", "host_op_s")

# Attention kernels' fwd+bwd rate as a share of the fastest fused kernel of the GPU generation
# (the hardware profile's attention_eff). Hopper: FlashAttention-3 / cuDNN's fused attention
# (Shah et al. 2024, arXiv 2407.08608: 1.5-2x FlashAttention-2 forward, 1.5-1.75x backward);
# FlashAttention-2 (PyTorch SDPA's flash backend) runs ~0.58 of it; FlexAttention ~0.875 of
# FlashAttention-2 (PyTorch blog "FlexAttention", 2024); the Triton flash-attention kernel of
# 2023 ~0.6 of FlashAttention-2 (Dao 2023, arXiv 2307.08691: FlashAttention-2 1.3-2.5x the
# Triton implementation). Ampere: FlashAttention-2 is the fastest kernel (FlashAttention-3 and
# cuDNN's Hopper paths do not run there).
ATTENTION_SHARE = {
    "hopper": {"fa3": 1.0, "fa2": 0.585, "flex": 0.51, "triton": 0.35},
    "ampere": {"fa3": 1.0, "fa2": 1.0, "flex": 0.875, "triton": 0.6},
}


@dataclass(frozen=True)
class Runtime:
    """A training framework's behaviour on a GPU (module doc)."""
    name: str
    about: str
    fused_pointwise: bool
    attention: str                 # a key of ATTENTION_SHARE's tables
    tp_overlap: str                # one of TP_OVERLAPS
    dp_stream: bool
    optimizer_bytes: float
    host_op_s: float               # fitted
    compute_share: float = 1.0     # fitted
    dispatch_per_rank: bool = False
    shards_experts: bool = True

    def __post_init__(self):
        if self.tp_overlap not in TP_OVERLAPS:
            raise ValueError(f"runtime {self.name}: tp_overlap must be one of {TP_OVERLAPS}")
        if self.attention not in ATTENTION_SHARE["hopper"]:
            raise ValueError(f"runtime {self.name}: unknown attention kernel {self.attention!r}")
        if not 0 < self.compute_share <= 1 or self.host_op_s < 0:
            raise ValueError(f"runtime {self.name}: compute_share must be in (0, 1] and "
                             f"host_op_s >= 0")


# Eager PyTorch launches a kernel in ~5-10 us of host time (dispatcher, autograd recording; a
# tiny eager op measured 2-7 us on this project's CPU calibration, autograd's backward node as
# much again); fused frameworks launch fewer, larger kernels and spend less per launch.
_EAGER_HOST = 8e-6
_FUSED_HOST = 4e-6

# The runtimes with their fitted terms at their priors (compute_share 1: the microbenchmark's
# rates; host_op_s: _EAGER_HOST or _FUSED_HOST): what cross-validation falls back to for a
# family none of whose rows are left to fit on.
PRIORS: dict[str, Runtime] = {r.name: r for r in (
    Runtime("fxpar", "fxpar's own runtime: eager PyTorch ops, torch SDPA (FlashAttention-2), "
                     "tensor-parallel collectives waited on, data-parallel buckets overlapped "
                     "with backward", fused_pointwise=False, attention="fa2", tp_overlap="none",
            dp_stream=True, optimizer_bytes=28, host_op_s=_EAGER_HOST, shards_experts=False),
    Runtime("megatron", "Megatron-Core with Transformer Engine: fused kernels, cuDNN attention, "
                        "tensor-parallel communication pipelined with its GEMMs "
                        "(--tp-comm-overlap), the distributed optimizer's reduce-scatter and "
                        "all-gather overlapped with backward and forward",
            fused_pointwise=True, attention="fa3", tp_overlap="pipelined", dp_stream=True,
            optimizer_bytes=30, host_op_s=_FUSED_HOST),
    Runtime("megatron-lm", "Megatron-LM before Transformer Engine (2021-2022): its own fused "
                           "kernels (softmax, bias-GELU, layer norm), the input gradient's "
                           "tensor-parallel all-reduce overlapped with the weight-gradient GEMM",
            fused_pointwise=True, attention="fa3", tp_overlap="backward", dp_stream=True,
            optimizer_bytes=30, host_op_s=_FUSED_HOST),
    Runtime("torchtitan", "torchtitan, eager: FSDP2 with prefetch, torch SDPA "
                          "(FlashAttention-2), one kernel per op",
            fused_pointwise=False, attention="fa2", tp_overlap="none", dp_stream=True,
            optimizer_bytes=28, host_op_s=_EAGER_HOST),
    Runtime("torchtitan-compile", "torchtitan with torch.compile: FSDP2, pointwise chains "
                                  "fused by Inductor, torch SDPA (FlashAttention-2)",
            fused_pointwise=True, attention="fa2", tp_overlap="none", dp_stream=True,
            optimizer_bytes=28, host_op_s=_FUSED_HOST),
    Runtime("fsdp", "PyTorch FSDP (FullyShardedDataParallel, as Composer and fms-fsdp run it): "
                    "eager ops, backward prefetch, flash attention",
            fused_pointwise=False, attention="fa2", tp_overlap="none", dp_stream=True,
            optimizer_bytes=28, host_op_s=_EAGER_HOST),
    Runtime("automodel", "NeMo AutoModel: FSDP2 with Transformer Engine's fused kernels and "
                         "cuDNN attention, DeepEP's expert dispatch",
            fused_pointwise=True, attention="fa3", tp_overlap="none", dp_stream=True,
            optimizer_bytes=28, host_op_s=_FUSED_HOST, dispatch_per_rank=True),
)}

DEFAULT = "fxpar"

# Runtimes that share their fitted terms: the same mechanism under other names. Every
# FSDP-based runtime gathers each layer's weights into fresh buffers and reduce-scatters its
# gradients from them, beside compute, with hooks around every module (torchtitan, NeMo
# AutoModel, Composer's and fms-fsdp's FSDP); fxpar's runtime does the same in its own sharded
# data parallel (runtime.data_parallel.sharded_dp), with eager ops and autograd hooks, and has no
# published GPU run of its own: it takes the FSDP family's terms. Megatron-Core and Megatron-LM
# are the other family. A fit sets one compute_share and one host_op_s per family; a fused
# member launches its kernels in the share _FUSED_HOST / _EAGER_HOST of an eager one's time.
FAMILY = {"fxpar": "fsdp", "megatron": "megatron", "megatron-lm": "megatron",
          "torchtitan": "fsdp",
          "torchtitan-compile": "fsdp", "fsdp": "fsdp", "automodel": "fsdp"}


def with_fitted(runtime: Runtime, compute_share: float, host_op_s: float) -> Runtime:
    """`runtime` with its family's fitted terms: host_op_s is an eager runtime's launch time,
    scaled for a fused one as its prior is."""
    prior = PRIORS[runtime.name]
    return dataclasses.replace(prior, compute_share=compute_share,
                               host_op_s=host_op_s * prior.host_op_s / _EAGER_HOST)


# (compute_share, host_op_s as an eager runtime's) per family, fitted on every published row of
# the family (`fxpar validate --fit`, planner.bench.published_fit: 9 Megatron rows, 202 FSDP
# rows); their check on runs they were not fitted to is `fxpar validate --cross-validate`.
FITS = {"megatron": (0.960, 3.8e-6), "fsdp": (0.783, 14.2e-6)}

RUNTIMES: dict[str, Runtime] = {name: with_fitted(r, *FITS[FAMILY[name]])
                                for name, r in PRIORS.items()}


def get_runtime(name: str | Runtime | None) -> Runtime:
    if isinstance(name, Runtime):
        return name
    if name is None:
        return RUNTIMES[DEFAULT]
    if name not in RUNTIMES:
        raise ValueError(f"unknown runtime {name!r}; known runtimes: {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def apply(hw, runtime: str | Runtime | None = None, attention: str | None = None):
    """The Cluster that prices `runtime` on the hardware profile `hw`; `attention` names
    another attention kernel than the runtime's (a published run's). A CPU profile, and any
    profile `fxpar calibrate` measured the runtime on, is returned as it is: calibration
    measured fxpar's runtime there with the hardware, and no other runtime is priced on it."""
    rt = get_runtime(runtime)
    if hw.device == "cpu" and rt.name != DEFAULT:
        raise ValueError(f"runtime {rt.name} runs on GPUs; the cluster {hw.name} is CPU "
                         f"ranks, where only fxpar's own runtime runs: drop --runtime or "
                         f"pick a GPU cluster")
    if hw.runtime_priced:   # `fxpar calibrate` measured fxpar's runtime on this machine
        if rt.name != DEFAULT:
            raise ValueError(f"the profile {hw.name} measured fxpar's own runtime (fxpar "
                             f"calibrate); price {rt.name} on a hardware preset instead")
        return hw
    if hw.device == "cpu":
        return hw
    kernel = attention or rt.attention
    shares = ATTENTION_SHARE.get(hw.gpu_arch)
    if shares is None:
        raise ValueError(f"cluster {hw.name} names no GPU generation (gpu_arch: one of "
                         f"{', '.join(ATTENTION_SHARE)}): its attention kernels are unknown")
    return dataclasses.replace(
        hw, runtime=rt.name, fused_pointwise=rt.fused_pointwise, tp_overlap=rt.tp_overlap,
        comm_stream=rt.dp_stream, dispatch_per_rank=rt.dispatch_per_rank,
        shards_experts=rt.shards_experts,
        optimizer_bytes=rt.optimizer_bytes, host_op_s=rt.host_op_s,
        matmul_eff=hw.matmul_eff * rt.compute_share,
        attention_eff=hw.attention_eff * shares[kernel] * rt.compute_share)
