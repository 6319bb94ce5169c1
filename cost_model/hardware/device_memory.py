"""What a GPU's memory holds beyond a rank's live tensors: named terms, each with its source.

The planner's per-rank peak (planner.search.solved.rank_memory) counts live tensor bytes, what
runtime.observe.memory_tracker measures and `torch.cuda.max_memory_allocated` reports. A device
also holds, before and beside them:

  context     the CUDA context and the kernels loaded into it (PyTorch's, cuBLAS's, NCCL's):
              700+ MiB on recent GPUs, by the driver and CUDA version (a PyTorch process shows
              ~720 MiB after its first CUDA tensor: discuss.pytorch.org/t/73021, /t/81330);
              outside PyTorch's allocator, so max_memory_reserved does not show it
  workspaces  cuBLAS and cuBLASLt workspaces per stream: 32 MiB on Hopper, 4 MiB before
              (PyTorch's CublasHandlePool defaults, after the cuBLAS guide's
              cublasSetWorkspace recommendation; pytorch/pytorch#120925), two streams (compute
              and the one collectives run on)
  nccl        each NCCL communicator's staging buffers: NCCL_BUFFSIZE (4 MiB by default, NCCL
              environment-variable guide) per channel for each of the two ring neighbours it
              sends to and receives from, at the NVLink channel count NCCL uses on an
              NVSwitch node (16 on DGX A100/H100 with NCCL 2.18+): 16 x 2 x 4 MiB = 128 MiB per
              process group a rank communicates in (data-, tensor-, context-, pipeline-,
              expert-parallel: each its own communicator). An estimate from the documented
              defaults: NVLink SHARP (NVLS) and user-buffer registration take more, and are off
              unless asked for.
  reserve     the caching allocator keeps freed blocks for reuse and splits large blocks, so
              what it reserves can exceed what tensors hold (max_memory_reserved over
              max_memory_allocated; PyTorch's CUDA-semantics notes on fragmentation). With
              expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which
              torchtitan's launch script sets) segments grow in place and the two stay close;
              without, fragmentation can take several percent. Not measured by this project
              on a device yet, so 1 (no reserve) until a GPU run sets it.

`DeviceMemory.usable(limit, groups)` is what the planner lets tensors take of a device limit;
`device_bytes` is what it adds to a predicted tensor peak. CPU ranks have none of these.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class DeviceMemory:
    context_bytes: float = 0.0
    workspace_bytes: float = 0.0
    nccl_bytes_per_group: float = 0.0
    reserve: float = 1.0          # allocator's reserved over allocated at the peak

    def fixed_bytes(self, groups: int) -> float:
        """What a rank's device holds that no tensor is: context, workspaces, NCCL buffers of
        `groups` communicators."""
        return self.context_bytes + self.workspace_bytes + groups * self.nccl_bytes_per_group

    def usable(self, limit: float, groups: int) -> float:
        """The bytes live tensors may peak at within a device limit."""
        return max(0.0, (limit - self.fixed_bytes(groups)) / self.reserve)

    def device_bytes(self, tensor_peak: float, groups: int) -> float:
        """A tensor peak as the device's memory use."""
        return tensor_peak * self.reserve + self.fixed_bytes(groups)


NONE = DeviceMemory()

_BY_ARCH = {
    "hopper": DeviceMemory(700 * MiB, 2 * 2 * 32 * MiB, 16 * 2 * 4 * MiB),
    "ampere": DeviceMemory(700 * MiB, 2 * 2 * 4 * MiB, 16 * 2 * 4 * MiB),
}


def device_memory(cluster) -> DeviceMemory:
    """The terms of a cluster's devices: by GPU generation; none on CPU ranks (and on GPU
    profiles that name no generation: their limit is taken as the tensors' own)."""
    if cluster.device == "cpu":
        return NONE
    return _BY_ARCH.get(cluster.gpu_arch, NONE)


def groups_of(dp: int, tp: int, pp: int, cp: int, ep: int = 1) -> int:
    """The communicators a rank of the mesh works in: one per parallel axis over one rank."""
    return sum(n > 1 for n in (dp, tp, pp, cp, ep))
