"""Activation checkpointing applied from outside the model.

"full": each transformer block keeps only its input during forward and
recomputes its activations in backward. The block's `forward` is replaced on the
instance, so module names (and therefore checkpoints) stay the same.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    for block in model.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
