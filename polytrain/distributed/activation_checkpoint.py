"""Activation checkpointing applied from outside the model.

"full": each transformer block keeps only its input during forward and
recomputes its activations in backward. "selective" (Megatron's): only the
attention core, softmax(q k^T) v, is recomputed: its saved activations grow with
the square of the sequence length while it costs few FLOPs to redo. Methods are
replaced on the instance, so module names (and therefore checkpoints) stay the same.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap the blocks of `model.layers` (a pipeline stage: the blocks it holds) for `mode`."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return
    for block in model.layers.values():
        if mode == "full":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        else:
            attention = block.attention
            attention.core = functools.partial(checkpoint, attention.core, use_reentrant=False)
