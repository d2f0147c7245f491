"""Value models (reward models, critics): a decoder whose output projection is a scalar head.

    cfg.head = "value"; model = ARCHITECTURES[arch].build(cfg)   # the registry attaches the head
    model(tokens) (B, T) -> values (B, T)

The head sits where the vocabulary projection was (`output`, weight (1, dim), no bias, as
DeepSpeed-Chat's v_head), so every other parameter keeps its name: a language model's
checkpoint loads by name (all but `output.weight`), per-block data parallelism and
initialisation by name see the model they know, and the architectures' model files stay
untouched. The value at position t scores the sequence up to token t; a reward model's
score of a whole sequence is its value at the last real token (`rlhf.losses.end_scores`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

HEAD = "output"
"""Name of the scalar head, the vocabulary projection's slot."""


class ScalarHead(nn.Linear):
    """hidden (B, T, dim) -> one value per position (B, T), in the hidden states' dtype."""

    def __init__(self, dim: int, device: torch.device | str | None = None):
        super().__init__(dim, 1, bias=False, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden).squeeze(-1)


def attach_scalar_head(model: nn.Module) -> nn.Module:
    """Turn a decoder holding its output projection into a value model in place and return it.

    A model with tied embeddings is untied (`model.cfg.tie_embeddings` becomes False): the
    head is no longer the embedding table's transpose.
    """
    old = getattr(model, HEAD, None)
    if old is None:
        raise ValueError("a value head replaces the output projection; this model (or pipeline stage) has none")
    model.cfg = dataclasses.replace(model.cfg, tie_embeddings=False, head="value")
    setattr(model, HEAD, ScalarHead(model.cfg.dim, device=old.weight.device))
    model._record_shapes()  # output.weight is now (1, dim); init_parameter checks full shapes
    return model


def is_scalar_model(model: nn.Module) -> bool:
    """Whether `model` returns one value per position (its head is a ScalarHead)."""
    return isinstance(getattr(model, HEAD, None), ScalarHead)
