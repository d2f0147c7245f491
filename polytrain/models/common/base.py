"""What every polytrain model offers the trainer, materialize and checkpoints.

    model.init_parameter(name, full_fp32_cpu_tensor, generator)   # fill one parameter, whole
    model.init_buffers()                                          # recompute derived buffers
    model.num_params(exclude_embeddings=False)
    model.flops_per_token(seq_len)

plus tied embeddings that stay tied when a meta-device model is given storage
(`to_empty` makes a new Parameter per module). Subclasses build their modules, then
call `self._record_shapes()`, and override `_init` where their initialisation differs
from the GPT rule (norm gains 1, biases 0, weights N(0, 0.02), residual output
projections scaled by 1/sqrt(2 * blocks)).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from polytrain.config import ModelConfig

_BLOCK_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def head_dim(cfg: ModelConfig) -> int:
    """Per-head size: model.head_dim, or dim / n_heads when it is 0."""
    return cfg.head_dim or cfg.dim // cfg.n_heads


def check_resolved(cfg: ModelConfig, fields: tuple[str, ...]) -> None:
    """ValueError naming the model fields still 0 (an unresolved size preset)."""
    unset = [k for k in fields if getattr(cfg, k) <= 0]
    if unset:
        raise ValueError(f"model fields {', '.join(unset)} are unset; resolve the size preset "
                         "first (polytrain.config.resolve_model)")


class ModelBase(nn.Module):
    """Shared protocol of the zoo's models; `cfg` is the resolved ModelConfig."""

    cfg: ModelConfig
    init_std = 0.02
    residual_out: tuple[str, ...] = ("attention.wo.weight", "feed_forward.w2.weight")
    """Block parameters that write into the residual stream; their init shrinks with depth."""
    lookup_tables: tuple[str, ...] = ("tok_embeddings",)
    """Embedding tables: looked up, not multiplied, so not counted in 6N unless tied to the output."""

    def _record_shapes(self) -> None:
        # Full shapes at construction, before any sharding: init_parameter checks against
        # them even when a parameter is later split, deleted (pipeline) or swapped.
        self._full_shapes = {n: tuple(p.shape) for n, p in self.named_parameters()}

    def tie_weights(self) -> None:
        """Make the output projection use the token-embedding table (when cfg.tie_embeddings)."""
        emb, out = getattr(self, "tok_embeddings", None), getattr(self, "output", None)
        if self.cfg.tie_embeddings and emb is not None and out is not None:
            out.weight = emb.weight

    def _apply(self, fn, recurse=True):
        # Converting meta parameters (to_empty) makes a new Parameter per module,
        # which unties output from tok_embeddings; tie them again.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def init_buffers(self) -> None:
        """Recompute derived buffers on the device they are on now (after to_empty); none by default."""

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `tensor`, the full-size fp32 CPU value of parameter `name`, in place."""
        expected = self._full_shapes.get(name)
        if expected is None:
            raise ValueError(f"{type(self).__name__} has no parameter named {name!r}")
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has full shape {expected}, got a tensor of {tuple(tensor.shape)}")
        self._init(name, tensor, generator)

    def _init(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, self.init_std * self._depth_scale(name), generator=generator)

    def _depth_scale(self, name: str) -> float:
        """1/sqrt(2 * blocks) for residual output projections, else 1."""
        block = _BLOCK_NAME.fullmatch(name)
        if block and block.group(2) in self.residual_out:
            return 1.0 / math.sqrt(2 * self._n_blocks())
        return 1.0

    def _n_blocks(self) -> int:
        return self.cfg.n_layers

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters held by this module (tied ones once; a pipeline stage counts its own part).

        exclude_embeddings drops the lookup tables (token, position, segment), except a
        token table tied to the output projection: there it is a matmul weight and counts.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            out = getattr(self, "output", None)
            for name in self.lookup_tables:
                table = getattr(self, name, None)
                if table is not None and not (out is not None and out.weight is table.weight):
                    total -= table.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6 N + 12 L w T.

        N = num_params(exclude_embeddings=True): every matmul weight (plus the negligible
        norm gains and biases) but not the lookup tables; the second term is attention
        scores and their weighted sum for L blocks of attention width w = heads x head
        size over T = seq_len, ignoring causality.
        """
        width = self.cfg.n_heads * head_dim(self.cfg)
        return 6.0 * self.num_params(exclude_embeddings=True) + 12.0 * len(self.layers) * width * seq_len
