"""Bytes per parameter that training keeps for the whole step: weights, gradients, optimizer states.

Counts follow Rajbhandari et al. 2020 (ZeRO, section 3.1): mixed-precision Adam holds 16-bit
weights and gradients (2 + 2 bytes) and K = 12 bytes of optimizer state (an fp32 master copy of the
weights and two fp32 moments); ZeRO stage 1 partitions those K bytes over the data-parallel group,
leaving 2 + 2 + K/dp per parameter on each rank.

At the optimizer step, 16-bit weights are stepped through their master copy with an fp32 copy of
their gradient (MASTER_BYTES more per parameter stepped, `step_share`), which is a rank's peak
when its activations are smaller.

Optimizer states per parameter, fp32 each:
  adam       2 (first and second moment)
  sgd        1 (the momentum buffer)
  adafactor  0: its second moment is factored into one row and one column vector per matrix
             (Shazeer & Stern 2018), n + m values for n*m weights, and it keeps no first moment,
             so per parameter it is negligible (< 0.1% of one state for h >= 4096).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPTIMIZER_STATES", "STATE_BYTES", "MASTER_BYTES", "TrainingMemory"]

OPTIMIZER_STATES = {"adam": 2, "sgd": 1, "adafactor": 0}
STATE_BYTES = 4   # optimizer states are kept in fp32 whatever the weights' precision
MASTER_BYTES = 4  # the fp32 master copy that mixed precision updates


@dataclass(frozen=True)
class TrainingMemory:
    """How training stores each parameter; see the module docstring for the counts.

    master_weights keeps an fp32 copy of 16-bit weights for the update (ignored for fp32 weights,
    which are their own master copy); zero1 partitions the optimizer states, master copy included,
    over the data-parallel group."""

    param_dtype_bytes: int = 2
    grad_dtype_bytes: int = 2
    optimizer: str = "adam"
    master_weights: bool = True
    zero1: bool = False

    def __post_init__(self):
        for name in ("param_dtype_bytes", "grad_dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, "
                             f"got {self.optimizer!r}")

    @staticmethod
    def for_dtype(dtype_bytes: int, zero1: bool = False) -> "TrainingMemory":
        """The usual recipe for a model stored in `dtype_bytes`: mixed-precision Adam for 16-bit
        weights (2 + 2 + 12), plain Adam for fp32 ones (4 + 4 + 8); optionally ZeRO-1."""
        return TrainingMemory(dtype_bytes, dtype_bytes, "adam", master_weights=dtype_bytes < 4,
                              zero1=zero1)

    @property
    def weight_bytes(self) -> int:
        return self.param_dtype_bytes

    @property
    def grad_bytes(self) -> int:
        return self.grad_dtype_bytes

    def optimizer_bytes(self, dp: int = 1) -> float:
        """Optimizer states (master copy included) per parameter on one rank of a dp group."""
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"dp must be a positive integer, got {dp!r}")
        master = MASTER_BYTES if self.master_weights and self.param_dtype_bytes < MASTER_BYTES else 0
        states = master + OPTIMIZER_STATES[self.optimizer] * STATE_BYTES
        return states / dp if self.zero1 else float(states)

    def step_share(self) -> float:
        """Bytes the optimizer step adds per byte of optimizer state: 16-bit weights are
        stepped through their fp32 main copy with an fp32 copy of their gradient, made for the
        step (runtime.training.main_weights), one per parameter the optimizer steps
        (MASTER_BYTES of its master + states bytes); fp32 weights are stepped as they are."""
        if not (self.master_weights and self.param_dtype_bytes < MASTER_BYTES):
            return 0.0
        return MASTER_BYTES / (MASTER_BYTES + OPTIMIZER_STATES[self.optimizer] * STATE_BYTES)

    def per_param(self, dp: int = 1) -> float:
        """Weights + gradients + optimizer states per parameter on one rank."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes(dp)
