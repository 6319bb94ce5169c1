"""The cluster presets: hardware profiles of this CPU kind and of DGX A100, H100 and H200 nodes,
each number with its public source. What a training framework does with the hardware is a
runtime profile's (cost_model.hardware.runtimes)."""
from __future__ import annotations

import dataclasses

from cost_model.hardware.spec import Cluster

__all__ = ["GB", "GiB", "PRESETS"]

GB = 1e9  # vendor datasheets use decimal units
GiB = float(2**30)

# mem_bytes uses the datasheet's decimal GB, less than the card gives a process (an 80 GB card
# reports about 79 GiB, 85 GB, as its total capacity). The CUDA context, workspaces and NCCL
# buffers are counted against this cap (cost_model.hardware.device_memory); the ~5 GB between
# the two is the margin for what that module does not measure yet (the caching allocator's
# reserve and fragmentation, left at 1 until a GPU run sets it).

# Efficiencies shared by the NVIDIA presets: what the hardware does, measured by public
# microbenchmarks; what a training framework makes of it is a runtime profile's
# (cost_model.hardware.runtimes). Sources:
# - matmul_eff: the Maximum Achievable Matmul FLOPS of the GPU, the best large bf16 GEMM's rate
#   over the datasheet peak (S. Bekman, ml-engineering, compute/accelerator/README.md, "Maximum
#   Achievable Matmul FLOPS comparison table", mamf-finder.py): A100 SXM 267.9 of 312 TFLOP/s
#   (85.9%), H100 SXM 792.1 of 989 (80.1%). Smaller and skinnier GEMMs reach less: tile and wave
#   quantisation (compute.gemm_efficiency) on top.
# - attention_eff: the fastest fused attention kernel's forward + backward rate (backward 2.5x
#   the forward's FLOPs) at head dim 128 and 4-8K tokens. A100: FlashAttention-2 (Dao 2023,
#   arXiv 2307.08691) ~70% of peak forward, ~60% backward: 0.625. H100: FlashAttention-3 / cuDNN
#   (Shah et al. 2024, arXiv 2407.08608) ~65% forward, ~50% backward: 0.535. Other kernels are a
#   share of it (runtimes.ATTENTION_SHARE).
# - bw_eff: streaming kernels reach ~80-90% of HBM bandwidth (STREAM-like copy); PyTorch
#   elementwise kernels sit at the low end: 0.80.
# - kernel_floor: a kernel's least time on the device, ~5 us launch to completion.
# - comm_eff: nccl-tests bus bandwidth on DGX systems is ~75-85% of nominal
#   NVLink / InfiniBand rate for large messages: 0.80.
# - latencies: NCCL's own tuning model (src/graph/tuning.cc, hwLat) charges
#   a few us per ring step over NVLink and ~5-15 us over the network.
# - dp_overlap: DDP's bucketed all-reduce (Li et al., VLDB 2020) overlaps all
#   but roughly the last bucket with backward: 0.70. Unused on these presets
#   (comm_stream): their data-parallel collectives are scheduled beside the
#   compute they overlap, slowing it by comm_sm_share, the SMs NCCL's blocks
#   hold: one block per channel, 16 channels (its usual count for rings over
#   NVLink and eight NICs) of the GPU's SMs.
# - nic_per_gpu: DGX nodes are rail-optimised (one compute NIC per GPU).
_GPU_EFFS = dict(
    bw_eff=0.80,
    kernel_floor=5e-6,
    comm_eff=0.80,
    intra_latency=5e-6,
    inter_latency=10e-6,
    dp_overlap=0.70,  # unused where comm_stream: the overlap is scheduled
    nic_per_gpu=True,
    comm_stream=True,
)
_A100 = dict(matmul_eff=0.859, attention_eff=0.625, gpu_arch="ampere", sms=108,
             comm_sm_share=16 / 108)
# - grouped_gemm_eff: a MoE layer's experts in one grouped GEMM kernel. cuBLAS's grouped GEMM
#   kernels "only leverage warp-level MMA instructions", not Hopper's warp-group wgmma (NVIDIA,
#   "Introducing Grouped GEMM APIs in cuBLAS and More Performance Updates", 2024), and on Hopper
#   the asynchronous TMA + wgmma path runs matrix multiplication 1.5x the synchronous one (Luo
#   et al., "Dissecting the NVIDIA Hopper Architecture through Microbenchmarking", arXiv
#   2501.12084): 1 / 1.5 on H100/H200; Ampere has no wgmma, 1.
_H100 = dict(matmul_eff=0.801, attention_eff=0.535, gpu_arch="hopper", sms=132,
             comm_sm_share=16 / 132, grouped_gemm_eff=1 / 1.5)

PRESETS: dict[str, Cluster] = {
    # This kind of machine: a 2-core x86 VM (AVX2, no AVX-512) running one
    # gloo rank per process, each with one torch thread. Rounded from what an
    # earlier `fxpar calibrate` measured here (median timings; today's
    # calibration times collectives by their fastest op, which gives ~0.2 ms
    # latency and ~1 GB/s, and prices causal attention fwd+bwd at ~25% of
    # peak); run it for this machine's numbers. Left as they were so that
    # plans chosen on this preset stay put. A "node" is
    # as many ranks as there are cores: larger groups time-share cores, and
    # every ring step then also waits for the scheduler, which the model
    # treats as a slower inter-node link (see calibrate._cpu_ranks_per_node).
    "cpu-gloo": Cluster(
        name="cpu-gloo",
        device="cpu",
        gpus_per_node=2,
        peak_flops=100e9,  # ~3 GHz x 32 fp32 FLOP/cycle (2 AVX2 FMA units)
        mem_bytes=4.0 * GiB,  # a share of host RAM per rank, kept modest
        mem_bw=20 * GB,  # single-thread copy measured 16-25 GB/s
        intra_bw=0.7 * GB,  # gloo over loopback TCP, full-duplex ring rate
        inter_bw=0.6 * GB,
        intra_latency=500e-6,  # includes scheduler wake-ups on a busy host
        inter_latency=1.2e-3,
        matmul_eff=0.75,  # 256-2048 fp32 GEMMs reached 70-90 GFLOP/s
        attention_eff=0.60,
        bw_eff=0.85,
        kernel_floor=5e-6,  # a tiny eager op measured 2-7 us
        comm_eff=1.0,  # the bandwidths above are already achieved rates
        dp_overlap=0.30,  # gloo's thread competes with compute for the cores
        # (latency, bandwidth) multipliers of the ring terms, from how gloo
        # implements these kinds (comm.py): reduce_scatter runs a whole
        # all-reduce (twice the ring's steps and volume), and only one side
        # of a p2p transfer copies, so it moves at twice the ring rate. A
        # calibrated profile measures all five kinds instead.
        comm_corrections={"reduce_scatter": (2.0, 0.5), "p2p": (1.0, 2.0)},
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS
    # dense (624 with sparsity), 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s
    # (total, both directions). NVIDIA DGX A100 datasheet: 8 GPUs, 8x
    # single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute = 25 GB/s
    # per GPU.
    "a100-80g-dgx": Cluster(
        name="a100-80g-dgx",
        device="cuda",
        gpus_per_node=8,
        peak_flops=312e12,
        mem_bytes=80 * GB,
        mem_bw=2039 * GB,
        intra_bw=300 * GB,  # 600 GB/s bidirectional -> 300 per direction
        inter_bw=25 * GB,  # 200 Gb/s / 8
        **_A100,  # A100 SXM4: 108 SMs
        **_GPU_EFFS,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with
    # sparsity -> 989 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s
    # (bidirectional). NVIDIA DGX H100 datasheet: 8 GPUs, 8x ConnectX-7
    # 400 Gb/s NDR InfiniBand = 50 GB/s per GPU.
    "h100-sxm-dgx": Cluster(
        name="h100-sxm-dgx",
        device="cuda",
        gpus_per_node=8,
        peak_flops=989e12,
        mem_bytes=80 * GB,
        mem_bw=3350 * GB,
        intra_bw=450 * GB,  # 900 GB/s bidirectional -> 450 per direction
        inter_bw=50 * GB,  # 400 Gb/s / 8
        **_H100,  # H100 / H200 SXM5: 132 SMs
        **_GPU_EFFS,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with
    # sparsity -> 989 dense (same compute as H100), 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s. NVIDIA DGX H200 datasheet: 8 GPUs, 8x
    # ConnectX-7 400 Gb/s = 50 GB/s per GPU.
    "h200-sxm-dgx": Cluster(
        name="h200-sxm-dgx",
        device="cuda",
        gpus_per_node=8,
        peak_flops=989e12,
        mem_bytes=141 * GB,
        mem_bw=4800 * GB,
        intra_bw=450 * GB,
        inter_bw=50 * GB,
        **_H100,  # the same SMs, clocks and 700 W as the H100 SXM5
        **_GPU_EFFS,
    ),
}

# NVIDIA A100 datasheet (SXM4 40GB): the 80 GB part's compute and links with 40 GB of HBM2 at
# 1,555 GB/s.
PRESETS["a100-40g-dgx"] = dataclasses.replace(
    PRESETS["a100-80g-dgx"], name="a100-40g-dgx", mem_bytes=40 * GB, mem_bw=1555 * GB)

# Meta's Grand Teton hosts (the torchtitan paper's, arXiv 2410.06511, section 3.1): a DGX H100's
# GPUs, links and NICs, but the 96 GB HBM2e part at 2.4 TB/s and the 500 W power limit (DGX
# H100: 80 GB HBM3 at 3.35 TB/s, 700 W). No public microbenchmark gives the GEMM rate at 500 W:
# the tensor cores' sustained clock is estimated from dynamic power ~ f V^2 with V ~ f, so
# f ~ P^(1/3): (500 / 700)^(1/3) = 0.894 of the 700 W part's rates (an estimate, said so).
POWER_LIMITED = (500 / 700) ** (1 / 3)
PRESETS["h100-grand-teton"] = dataclasses.replace(
    PRESETS["h100-sxm-dgx"], name="h100-grand-teton", mem_bytes=96 * GB, mem_bw=2400 * GB,
    matmul_eff=_H100["matmul_eff"] * POWER_LIMITED,
    attention_eff=_H100["attention_eff"] * POWER_LIMITED)
