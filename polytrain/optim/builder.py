"""Optimizer construction: parameter groups with and without weight decay."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from polytrain.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear and embedding weights) decay; vectors (norm gains, biases) do not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return make_optimizer(param_groups(model, cfg.weight_decay), cfg)


def make_optimizer(groups: list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The configured optimizer over prepared groups (e.g. ZeRO's master shards in `param_groups`' grouping).

    Over sharded (DTensor) parameters, e.g. FSDP2's, the update runs as foreach ops:
    each costs one DTensor dispatch for all tensors, where torch's per-tensor loop (its
    choice on a CPU) pays one per tensor and op, as much as the arithmetic itself on a
    small model. The math is the same elementwise; plain tensors keep torch's choice.
    """
    sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])
    foreach = True if sharded else None
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 foreach=foreach)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=foreach)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")
