"""The learning rate of each step: a linear warm-up from 0 to the peak, then cosine, linear or
constant decay to min_lr, held there after decay_steps. A pure function of the step (1-based:
step 1 is the first optimizer step), so a resumed run sets the same rates as one that was never
interrupted."""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    peak: float
    warmup_steps: int = 0
    decay: str = "cosine"
    decay_steps: int = 0      # steps of decay after the warm-up
    min_lr: float = 0.0

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if not self.peak > 0 or self.min_lr < 0 or self.min_lr > self.peak:
            raise ValueError(f"need 0 <= min_lr <= peak and peak > 0, got peak {self.peak}, "
                             f"min_lr {self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup_steps and decay_steps must be >= 0")

    @classmethod
    def of(cls, config) -> "LRSchedule":
        """From a planner.training.config.TrainConfig; decay_steps 0: until the last step."""
        s = config.lr_schedule
        decay_steps = s.decay_steps or max(config.training.steps - s.warmup_steps, 0)
        return cls(config.optimizer.lr, s.warmup_steps, s.decay, decay_steps, s.min_lr)

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if step <= self.warmup_steps:
            return self.peak * step / self.warmup_steps
        if self.decay == "constant":
            return self.peak
        if self.decay_steps == 0:
            return self.min_lr
        t = min((step - self.warmup_steps) / self.decay_steps, 1.0)
        if self.decay == "linear":
            shape = 1.0 - t
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.min_lr + (self.peak - self.min_lr) * shape
