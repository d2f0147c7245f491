"""Learning-rate schedule: linear warmup, then cosine decay to min_lr.

The rate is a pure function of the step, so a checkpoint needs no scheduler
state beyond the step itself, and a resumed run may change lr or the length of
the run and get the schedule those values describe.
"""

from __future__ import annotations

import math

import torch

from polytrain.config import Config


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: Config) -> float:
    """Put the schedule's rate for `step` into every parameter group; returns it."""
    t = cfg.train
    lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=cfg.run.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
