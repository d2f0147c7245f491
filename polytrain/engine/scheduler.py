"""The learning-rate scheduler `polytrain.initialize` returns for a config's `scheduler` block."""

from __future__ import annotations

from typing import Any

import torch

from polytrain.optim.warmup_schedules import Schedule


class LRScheduler:
    """Puts a DeepSpeed schedule's rate into the optimizer's parameter groups.

    After n calls to `step()` every group's lr is `schedule.lr_at(n)`, so optimizer step n
    (0-based) runs at `lr_at(n)`: the convention of polytrain's trainer (see
    polytrain.optim.warmup_schedules), which makes an engine run and a `polytrain train` run of
    the same ds_config take the same steps. DeepSpeed's own scheduler gives step n the rate
    `lr_at(n - 1)` (its first two steps both run at `lr_at(0)`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule):
        self.optimizer, self.schedule = optimizer, schedule
        self.steps = 0
        """Calls to `step()` so far (DeepSpeed skips the call on an fp16 overflow step)."""
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule.lr_at(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """Advance to the next optimizer step's rate."""
        self.steps += 1
        self._apply()

    def get_lr(self) -> list[float]:
        """The schedule's rate for the next optimizer step, one entry per parameter group."""
        return [self.schedule.lr_at(self.steps)] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        """The rate last put into each parameter group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the step `state` was saved at; the schedule comes from this run's config."""
        self.steps = int(state["steps"])
        self._apply()
