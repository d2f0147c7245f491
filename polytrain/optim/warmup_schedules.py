"""DeepSpeed's warmup learning-rate schedules as pure functions of the step.

Each class holds one `scheduler` block of a ds_config.json, with DeepSpeed's
parameter names and every default already filled in, and `lr_at(step)` gives the
rate DeepSpeed's scheduler yields after `step` calls to its `step()` (its
`last_batch_iteration`). DeepSpeed applies that rate to its optimizer step
`step + 1` (its first step runs at the pre-warmup rate, and fp16 overflow steps do
not advance the scheduler); polytrain applies `lr_at(step)` to step `step`, so the
curve is the same, one step earlier.

Warmup, shared by all three: with n = max(2, warmup_num_steps) (DeepSpeed's floor,
since the log warmup divides by log n) and step s < n, the warmup fraction is
log(s + 1) / log(n) ("log", DeepSpeed's default) or s / n ("linear").

`to_train()` gives the polytrain `train.*` settings that describe the schedule and
`schedule_from_train` rebuilds the schedule from them, so a run's config.toml alone
reproduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Schedule", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "schedule_from_train"]


def _warmup_fraction(step: int, n: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(step + 1) / math.log(n)
    return step / n


@dataclass(frozen=True, kw_only=True)
class WarmupLR:
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then stay there."""

    warmup_min_lr: float
    warmup_max_lr: float
    warmup_num_steps: int
    warmup_type: str
    kind: ClassVar[str] = "ds_warmup"

    @property
    def _n(self) -> int:
        return max(2, self.warmup_num_steps)

    def _after_warmup(self, step: int) -> float:
        return 1.0

    def lr_at(self, step: int) -> float:
        """Learning rate at scheduler step `step` (0-based)."""
        if step < self._n:
            gamma = _warmup_fraction(step, self._n, self.warmup_type)
        else:
            gamma = self._after_warmup(step)
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma

    def to_train(self) -> dict[str, Any]:
        """The polytrain `train.*` settings that describe this schedule."""
        return {
            "train.lr_schedule": self.kind,
            "train.lr": self.warmup_max_lr,
            "train.warmup_start_lr": self.warmup_min_lr,
            # No decay; min_lr only has to stay at or below lr for polytrain's validation.
            "train.min_lr": self.warmup_min_lr,
            "train.warmup_steps": self.warmup_num_steps,
            "train.warmup_type": self.warmup_type,
        }


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay back to warmup_min_lr (0 by default) at total_num_steps.

    After warmup: lr = min + (max - min) * max(0, (T - s) / max(1, T - n)), T = total_num_steps.
    """

    total_num_steps: int
    kind: ClassVar[str] = "ds_warmup_decay"

    def _after_warmup(self, step: int) -> float:
        return max(0.0, (self.total_num_steps - step) / max(1, self.total_num_steps - self._n))

    def to_train(self) -> dict[str, Any]:
        return super().to_train() | {"train.schedule_steps": self.total_num_steps}


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLR:
    """Warm up from warmup_min_ratio x lr to lr, then cosine down to cos_min_ratio x lr.

    `lr` is the optimizer's learning rate, which DeepSpeed's WarmupCosineLR scales.
    After warmup, with p = min(1, (s - n + 1) / max(1, T - n)) (DeepSpeed counts the
    first step after warmup as 1 and holds the floor from T - 1 on):
    ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi p)) / 2).
    """

    lr: float
    total_num_steps: int
    warmup_min_ratio: float
    warmup_num_steps: int
    cos_min_ratio: float
    warmup_type: str
    kind: ClassVar[str] = "ds_warmup_cosine"

    def lr_at(self, step: int) -> float:
        """Learning rate at scheduler step `step` (0-based)."""
        n = max(2, self.warmup_num_steps)
        if step < n:
            fraction = _warmup_fraction(step, n, self.warmup_type)
            ratio = self.warmup_min_ratio + fraction * (1 - self.warmup_min_ratio)
        else:
            progress = min(1.0, (step - n + 1) / max(1, self.total_num_steps - n))
            cosine = (1 + math.cos(math.pi * progress)) / 2
            ratio = max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * cosine)
        return self.lr * ratio

    def to_train(self) -> dict[str, Any]:
        """The polytrain `train.*` settings that describe this schedule."""
        return {
            "train.lr_schedule": self.kind,
            "train.lr": self.lr,
            "train.warmup_start_lr": self.warmup_min_ratio * self.lr,
            "train.min_lr": self.cos_min_ratio * self.lr,
            "train.warmup_steps": self.warmup_num_steps,
            "train.warmup_type": self.warmup_type,
            "train.schedule_steps": self.total_num_steps,
        }


Schedule = WarmupLR | WarmupDecayLR | WarmupCosineLR


def schedule_from_train(train: Any, run_steps: int) -> Schedule | None:
    """The schedule `to_train()` described, from a train config section; None for polytrain's own.

    `train` needs lr_schedule, lr, min_lr, warmup_steps, warmup_type, warmup_start_lr and
    schedule_steps (0 = `run_steps`). Ratios are recovered as warmup_start_lr / lr, so
    rates agree with the original to rounding.
    """
    kind = train.lr_schedule
    warmup = {"warmup_num_steps": train.warmup_steps, "warmup_type": train.warmup_type}
    total = train.schedule_steps or run_steps
    if kind == WarmupLR.kind:
        return WarmupLR(warmup_min_lr=train.warmup_start_lr, warmup_max_lr=train.lr, **warmup)
    if kind == WarmupDecayLR.kind:
        return WarmupDecayLR(
            warmup_min_lr=train.warmup_start_lr,
            warmup_max_lr=train.lr,
            total_num_steps=total,
            **warmup,
        )
    if kind == WarmupCosineLR.kind:
        lr = train.lr
        return WarmupCosineLR(
            lr=lr,
            total_num_steps=total,
            warmup_min_ratio=train.warmup_start_lr / lr if lr else 0.0,
            cos_min_ratio=train.min_lr / lr if lr else 0.0,
            **warmup,
        )
    return None
