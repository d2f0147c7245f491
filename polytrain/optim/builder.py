"""Optimizer construction: parameter groups with and without weight decay."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from polytrain.config import TrainConfig
from polytrain.optim.lamb import Lamb
from polytrain.optim.lars import Lars
from polytrain.optim.trust import SquareSums


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear and embedding weights) decay; vectors (norm gains, biases) do not.

    `adapt`: whether LAMB/LARS scale the group's steps by per-tensor trust ratios. Both
    papers exclude biases and norm gains (few elements, ||w|| near 0 or 1 says little
    about the step they tolerate); other optimizers ignore the key.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "adapt": True},
        {"params": no_decay, "weight_decay": 0.0, "adapt": False},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return make_optimizer(param_groups(model, cfg.weight_decay), cfg)


def make_optimizer(groups: list[dict], cfg: TrainConfig,
                   square_sums: SquareSums | None = None) -> torch.optim.Optimizer:
    """The configured optimizer over prepared groups (e.g. ZeRO's master shards in `param_groups`' grouping).

    `square_sums` (LAMB/LARS only) sums per-tensor squares over the ranks holding each
    tensor's pieces; the default reads DTensor placements (see trust.py). ZeRO-1/2 pass
    theirs, since their master shards are plain tensors.

    AdamW runs torch's fused kernel (one multi-tensor op per step) where the device has
    one, on plain tensors and DTensor shards (FSDP2's, tensor parallelism's) alike: on a
    CPU about 5x the speed of the per-tensor loop torch picks there by default, and 2-4x
    that of foreach ops over FSDP2 shards (benchmarks/optimizer_step.py, RESULTS.md).
    SGD over DTensors runs as foreach ops for the same reason. Neither on meshes of more
    than two axes (a 2d tp grid x dp): there DTensor's first multi-tensor dispatch
    enumerates every placement combination across the tensors, which takes minutes,
    where the per-tensor ops' propagation is quick and cached. The math is the same
    elementwise either way.
    """
    params = [p for g in groups for p in g["params"]]
    meshes = [p.device_mesh.ndim for p in params if isinstance(p, DTensor)]
    multi_tensor = not meshes or max(meshes) <= 2
    foreach = True if meshes and multi_tensor else None
    if cfg.optimizer == "adamw":
        fused = multi_tensor and bool(params) and all(
            p.device.type in _get_fused_kernels_supported_devices() for p in params)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 fused=fused or None, foreach=None if fused else foreach)
    if cfg.optimizer == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                    trust_clip=cfg.trust_clip, square_sums=square_sums)
    if cfg.optimizer == "lars":
        return Lars(groups, lr=cfg.lr, momentum=cfg.momentum, trust_clip=cfg.trust_clip,
                    square_sums=square_sums)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=foreach)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")
