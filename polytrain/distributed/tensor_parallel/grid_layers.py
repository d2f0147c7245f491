"""What the 2D/2.5D and 3D grid modes share: norms over a split hidden, vocabulary lookups, root.

summa.py and three_d.py place activations and weights on the grid; the pieces here
take the axes those layouts use as arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from polytrain.distributed.collectives import sum_across
from polytrain.distributed.tensor_parallel.grid import Grid
from polytrain.distributed.tensor_parallel.local_shard import local_shard


class GridNorm(nn.Module):
    """RMSNorm or LayerNorm of a residual stream whose hidden features are split along `hidden_axis`.

    Input (b, T, D/n) per rank, n = the axis' size. The statistics (sum of squares; for
    LayerNorm also the sum) are summed across that axis' group, forward and backward
    (sum_across). The gain (and bias) is split like the hidden, Shard(0) on
    `hidden_axis`, and held alike by the ranks along `batch_axes`, whose gradient
    parts (their sequences) are summed.
    """

    def __init__(self, norm: nn.Module, grid: Grid, hidden_axis: str, batch_axes: tuple[str, ...]):
        super().__init__()
        self.layer_norm = isinstance(norm, nn.LayerNorm)
        weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        if weight is None or not hasattr(norm, "eps") or (bias is not None and not self.layer_norm):
            raise ValueError(f"grid norm: {type(norm).__name__} is neither nn.LayerNorm nor an RMS norm "
                             "with `weight` and `eps`")
        self.dim, self.eps, self.grid = weight.shape[0], norm.eps, grid
        self.hidden_axis, self.batch_axes = hidden_axis, batch_axes
        if self.dim % grid.size(hidden_axis):
            raise ValueError(f"grid norm: {self.dim} features cannot be split {grid.size(hidden_axis)} ways")
        self.weight = grid.distribute(weight, **{hidden_axis: Shard(0)})
        self.bias = grid.distribute(bias, **{hidden_axis: Shard(0)}) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.grid.along(self.hidden_axis)
        xf = x.float()  # (b, T, D/n), fp32 statistics as RMSNorm computes them
        if self.layer_norm:
            xf = xf - sum_across(xf.sum(-1, keepdim=True), group) / self.dim
        normed = xf * torch.rsqrt(sum_across(xf.pow(2).sum(-1, keepdim=True), group) / self.dim + self.eps)
        out = normed * self.grid.shared(local_shard(self.weight), *self.batch_axes).float()
        if self.bias is not None:
            out = out + self.grid.shared(local_shard(self.bias), *self.batch_axes).float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "layer" if self.layer_norm else "rms"
        return f"{kind}, dim={self.dim}, split along {self.hidden_axis}"


def lookup(tokens: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Embeddings of `tokens` (n, T) from vocabulary rows [start, start + len(weight)); zeros elsewhere.

    weight (V_local, D_local) -> (n, T, D_local): a partial sum over the vocabulary blocks.
    """
    local = tokens - start
    inside = (local >= 0) & (local < weight.shape[0])
    return F.embedding(local.clamp(0, weight.shape[0] - 1), weight).masked_fill(~inside[..., None], 0.0)


def check_embedding(embedding: nn.Embedding, blocks: int, mode: str) -> None:
    if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
        raise ValueError(f"{mode} embedding supports neither padding_idx, max_norm nor sparse")
    if embedding.num_embeddings % blocks:
        raise ValueError(f"{mode} embedding: vocabulary {embedding.num_embeddings} cannot be split into "
                         f"{blocks} blocks")


def batch_block(tokens: torch.Tensor, parts: int, mode: str) -> None:
    """Fail unless the micro-batch (B, T) splits into `parts` groups of whole sequences."""
    if tokens.shape[0] % parts:
        raise ValueError(f"tp_mode {mode} gives each rank whole sequences: the micro-batch of "
                         f"{tokens.shape[0]} must be a multiple of {parts}")


def root(module: nn.Module, grid: Grid, cache_argument: str = "cache") -> nn.Module:
    """Per forward: the per-rank dropout stream; KV-cached decoding is refused (batch split by rank)."""
    inner = module.forward
    signature = inspect.signature(inner)

    def forward(*args, **kwargs):
        if signature.bind(*args, **kwargs).arguments.get(cache_argument) is not None:
            raise NotImplementedError(f"KV-cached decoding under tp_mode {grid.mode} is not supported; "
                                      "generate from the checkpoint on one process (polytrain generate)")
        with grid.rng(module.training):
            return inner(*args, **kwargs)

    module.forward = forward
    return module


def grid_roles(embedding: Callable, hidden_axis: str, batch_axes: tuple[str, ...], region: Callable,
               column: Callable, row: Callable, head: Callable) -> dict[str, Callable]:
    """A grid mode's plan-role implementations (plan.Mode.roles) from its layers.

    `region(module, grid)` wraps a region's input (or returns the module as is),
    `column(linear, grid, unit)`, `row(linear, grid)` and `head(linear, grid)` build the linears.
    """
    return {
        "root": lambda m, s, g: root(m, g, s.cache_argument),
        "vocab_embedding": lambda m, s, g: embedding(m, g),
        "norm": lambda m, s, g: GridNorm(m, g, hidden_axis, batch_axes),
        "region": lambda m, s, g: region(m, g),
        "column": lambda m, s, g: column(m, g, s.unit),
        "row": lambda m, s, g: row(m, g),
        "vocab_head": lambda m, s, g: head(m, g),
    }
