"""2D (Optimus, Xu et al. 2021) and 2.5D (Tesseract, Wang et al. 2021) tensor parallelism.

Rank (k, i, j) of a d x q x q grid (2D: d = 1, no k axis). Activations (B, T, D) are
split into (B/(dq), T, D/q) blocks: sequences by (k, i) (k outermost), hidden features
by j. Each rank gets whole sequences, so attention runs on its own sequences and its
own heads (head block j) without communication; the micro-batch must be a multiple of dq.

    role             weight (out, in) placement           per rank
    region           none                                 input (b, T, D/q) all-gathered along j
                                                          once: (b, T, D) for all its column layers
    column           out by j, in by i; depth-replicated  (b, T, in) -> (b, T, out/q)
    row              as column                            (b, T, in/q) -> (b, T, out/q)
    vocab_embedding  (V, D): V by i, D by j               tokens (B, T) -> (b, T, D/q)
    norm             (D,) by j                            (b, T, D/q) -> same; stats summed along j
    vocab_head       as row, out = V                      (b, T, D/q) -> logits (b, T, V/q)
    b = B / (dq)

A linear is SUMMA's product Y_ij = sum_k X_ik W_kj written as two all-gathers: the row's
input blocks (along j; for column layers done once by their region, as wq, wk and wv
read the same input) and the column's weight blocks (along i) -- what SUMMA's q
broadcast steps deliver, in one call each. Backward follows from autograd on those
pairs: reduce-scatters of the input gradient along j and of the weight gradient along
i. Tesseract's d depth layers each run that on their own sequences with the same
weight blocks, whose gradients are then summed along k. Autograd keeps the gathered row
input (b, T, in) and column weight (out/q, in) for backward, where SUMMA would broadcast
them again: memory traded for half the forward collectives.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from polytrain.distributed.collectives import gather_from_sp, reduce_scatter_to_sp
from polytrain.distributed.tensor_parallel.grid import Grid
from polytrain.distributed.tensor_parallel.grid_layers import (
    batch_block,
    check_embedding,
    grid_roles,
    lookup,
)
from polytrain.distributed.tensor_parallel.local_shard import local_shard

# The head's logits: sequences by (k, i), vocabulary by j.
LOGITS_BATCH_AXES, LOGITS_VOCAB_AXIS = ("tp_k", "tp_i"), "tp_j"


class SummaLinear(nn.Module):
    """y = x W^T + b on the grid: weight (out, in) block [out j, in i], bias (out,) block j.

    `unit`: output features that must stay on one rank (a head's head_dim). `row_input`:
    the input is already my grid row's, (b, T, in), gathered by the enclosing region.
    """

    product = staticmethod(F.linear)  # as one_d.ColumnParallelLinear.product (train.matmul_fp32)

    def __init__(self, linear: nn.Linear, grid: Grid, unit: int = 1, row_input: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.grid = linear.in_features, linear.out_features, grid
        self.row_input = row_input
        q = grid.q
        if self.in_features % q or self.out_features % (unit * q):
            raise ValueError(f"{grid.mode} linear ({self.in_features} -> {self.out_features}, units of {unit}) "
                             f"cannot be split over a {q} x {q} grid")
        self.weight = grid.distribute(linear.weight, tp_i=Shard(1), tp_j=Shard(0))  # local (out/q, in/q)
        self.bias = grid.distribute(linear.bias, tp_j=Shard(0)) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        w = g.shared(local_shard(self.weight), "tp_k")  # (out/q, in/q); depth layers' gradients summed
        x_row = x if self.row_input else gather_from_sp(x, -1, g.along("tp_j"))  # (b, T, in): my row's blocks
        w_col = gather_from_sp(w, 1, g.along("tp_i"))  # (out/q, in): my grid column's weight blocks
        b = g.shared(local_shard(self.bias), "tp_i", "tp_k") if self.bias is not None else None
        return self.product(x_row, w_col, b)  # (b, T, out/q)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, grid={self.grid.mode}"


class SummaEmbedding(nn.Module):
    """Token embedding on the grid: weight (V, D) block [V i, D j], replicated along depth.

    Every rank of the grid receives the same micro-batch (B, T). Depth layer k takes its
    B/d sequences; each rank looks them up in its vocabulary block (zeros for other
    tokens), and a reduce-scatter along i sums the vocabulary blocks while handing
    rank i its B/(dq) sequences. Backward: an all-gather along i.
    """

    def __init__(self, embedding: nn.Embedding, grid: Grid):
        super().__init__()
        check_embedding(embedding, grid.q, grid.mode)
        if embedding.embedding_dim % grid.q:
            raise ValueError(f"{grid.mode} embedding: width {embedding.embedding_dim} cannot be split {grid.q} ways")
        self.num_embeddings, self.embedding_dim, self.grid = embedding.num_embeddings, embedding.embedding_dim, grid
        self.start = grid.coord("tp_i") * self.num_embeddings // grid.q
        self.weight = grid.distribute(embedding.weight, tp_i=Shard(0), tp_j=Shard(1))  # local (V/q, D/q)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        g = self.grid
        batch_block(tokens, g.size("tp_k") * g.q, g.mode)
        mine = tokens.chunk(g.size("tp_k"))[g.coord("tp_k")]  # (B/d, T): this depth layer's sequences
        partial = lookup(mine, g.shared(local_shard(self.weight), "tp_k"), self.start)  # (B/d, T, D/q)
        return reduce_scatter_to_sp(partial, 0, g.along("tp_i"))  # (B/(dq), T, D/q)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, grid={self.grid.mode}"


def region(module: nn.Module, grid: Grid) -> nn.Module:
    """The module's first input (b, T, D/q) enters as my grid row's (b, T, D): one all-gather
    along j for all its column layers; backward reduce-scatters their summed input gradients."""
    inner = module.forward

    def forward(x, *args, **kwargs):
        return inner(gather_from_sp(x, -1, grid.along("tp_j")), *args, **kwargs)

    module.forward = forward
    return module


ROLES = grid_roles(SummaEmbedding, hidden_axis="tp_j", batch_axes=("tp_i", "tp_k"), region=region,
                   column=lambda m, g, unit: SummaLinear(m, g, unit, row_input=True),
                   row=SummaLinear, head=SummaLinear)
