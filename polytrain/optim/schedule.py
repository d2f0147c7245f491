"""Learning-rate schedule: linear warmup, then cosine decay to min_lr.

The rate is a pure function of the step, so a checkpoint needs no scheduler
state beyond the step itself, and a resumed run may change lr or the length of
the run and get the schedule those values describe.
"""

from __future__ import annotations

import math

import torch

from polytrain.config import Config
from polytrain.optim.warmup_schedules import schedule_from_train


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def scheduled_lr(step: int, cfg: Config) -> float:
    """The configured schedule's rate for optimizer step `step` (0-based)."""
    t = cfg.train
    if t.lr_schedule != "cosine":  # one of DeepSpeed's warmup schedules
        return schedule_from_train(t, cfg.run.steps).lr_at(step)
    return lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=cfg.run.steps)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: Config) -> float:
    """Put the schedule's rate for `step` into every parameter group; returns it."""
    lr = scheduled_lr(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
