"""Reward models and critics: a decoder whose output projection is replaced by a scalar head.

    model = ARCHITECTURES[arch].build(cfg)      # any polytrain decoder, on meta or real storage
    attach_scalar_head(model)                   # model(tokens) (B, T) -> values (B, T)

The head sits where the vocabulary projection was (`output`, weight (1, dim), no bias, as
DeepSpeed-Chat's v_head), so every other parameter keeps its name: an SFT checkpoint's
weights load by name (all but `output.weight`), per-block data parallelism, pipeline
units and initialisation by name see the model they know, and the model file itself
stays untouched. The value at position t scores the sequence up to token t; a reward
model's score of a whole sequence is its value at the last real token
(`losses.end_scores`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES

HEAD = "output"
"""Name of the scalar head, the vocabulary projection's slot."""


class ScalarHead(nn.Linear):
    """hidden (B, T, dim) -> one value per position (B, T), in the hidden states' dtype."""

    def __init__(self, dim: int, device: torch.device | str | None = None):
        super().__init__(dim, 1, bias=False, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden).squeeze(-1)


def attach_scalar_head(model: nn.Module) -> nn.Module:
    """Turn a polytrain decoder into a value model in place and return it (module docstring).

    A model with tied embeddings is untied (`model.cfg.tie_embeddings` becomes False): the
    head is no longer the embedding table's transpose.
    """
    arch = ARCHITECTURES.get(getattr(getattr(model, "cfg", None), "arch", ""))
    if arch is None or arch.kind != "decoder" or getattr(model, HEAD, None) is None:
        raise ConfigError("a reward model or critic needs a decoder holding its output head "
                          "(llama, gpt2, internlm2; not a pipeline stage without the head)")
    old = getattr(model, HEAD)
    model.cfg = dataclasses.replace(model.cfg, tie_embeddings=False)
    setattr(model, HEAD, ScalarHead(model.cfg.dim, device=old.weight.device))
    model._record_shapes()  # output.weight is now (1, dim); init_parameter checks full shapes
    return model


def is_scalar_model(model: nn.Module) -> bool:
    """Whether `model` returns one value per position (its head is a ScalarHead)."""
    return isinstance(getattr(model, HEAD, None), ScalarHead)

