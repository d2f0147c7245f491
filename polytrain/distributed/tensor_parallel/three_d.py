"""3D tensor parallelism (Bian et al. 2021, "Maximizing parallelism in distributed training ...").

Rank (i, j, l) of a q x q x q grid. A matrix product Y = X W runs as the 3D algorithm:
X's block (rows i, inner l) is spread over the q ranks along j, W's block (inner l,
columns j) over the q ranks along i; each rank all-gathers both, multiplies, and a
reduce-scatter along l sums the inner dimension while spreading Y's block (rows i,
columns j) over the ranks along l. Every rank exchanges data with 3(q - 1) peers.

Because the output is spread along l where the input was spread along j, two layouts
of the activations (B, T, D) alternate (b = B / q^2, whole sequences per rank):

    L0  sequences by (i, j), hidden by l: (b, T, D/q)   the residual stream, norms, embedding
    L1  sequences by (i, l), hidden by j: (b, T, F/q)   inside attention (head block j) and the MLP

    role             weight (out, in) placement           per rank
    column           out by (j, then i), in by l          L0 (b, T, in/q) -> L1 (b, T, out/q)
    row              out by (l, then i), in by j          L1 (b, T, in/q) -> L0 (b, T, out/q)
    vocab_embedding  (V, D): V by (j, then i), D by l     tokens (B, T) -> L0
    norm             (D,) by l                            L0 -> L0; stats summed along l
    vocab_head       as column, out = V                   L0 -> logits L1 (b, T, V/q)

Weights are split q^3 ways (each rank holds 1/q^3 of each), activations q^2 ways by
sequence and q ways by feature. Colossal-AI swaps the input and output groups between
consecutive layers the same way. Autograd keeps each linear's gathered input (B/q, T,
in/q) and weight block (out/q, in/q) for backward rather than gathering them again.
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

# The head's logits are in layout L1: sequences by (i, l), vocabulary by j.
LOGITS_BATCH_AXES, LOGITS_VOCAB_AXIS = ("tp_i", "tp_l"), "tp_j"


class Linear3D(nn.Module):
    """y = x W^T + b: input sequences by (i, `gather`), features by `scatter`; output the other way round.

    Column layers use gather = j, scatter = l (L0 -> L1); row layers the reverse (L1 -> L0).
    Weight (out, in): out split by `gather` then by i (q^2 blocks), in by `scatter`;
    bias (out,) split by `gather`, held alike along i and `scatter`.
    """

    product = staticmethod(F.linear)  # as one_d.ColumnParallelLinear.product (train.matmul_fp32)

    def __init__(self, linear: nn.Linear, grid: Grid, gather: str, scatter: str, unit: int = 1):
        super().__init__()
        self.in_features, self.out_features, self.grid = linear.in_features, linear.out_features, grid
        self.gather, self.scatter = gather, scatter
        q = grid.q
        if self.in_features % q or self.out_features % (q * q) or (self.out_features // unit) % q:
            raise ValueError(f"3d linear ({self.in_features} -> {self.out_features}, units of {unit}) cannot "
                             f"be split over a {q} x {q} x {q} grid")
        # Placements shard a tensor dim in mesh-axis order (tp_j, tp_l, tp_i): `gather` before i.
        self.weight = grid.distribute(linear.weight, **{gather: Shard(0), "tp_i": Shard(0), scatter: Shard(1)})
        self.bias = grid.distribute(linear.bias, **{gather: Shard(0)}) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        x_block = gather_from_sp(x, 0, g.along(self.gather))  # (B/q, T, in/q): sequences i, features `scatter`
        w_block = gather_from_sp(local_shard(self.weight), 0, g.along("tp_i"))  # (out/q, in/q)
        partial = self.product(x_block, w_block)  # (B/q, T, out/q): a part of the sum over in blocks
        y = reduce_scatter_to_sp(partial, 0, g.along(self.scatter))  # (B/q^2, T, out/q)
        if self.bias is not None:
            y = y + g.shared(local_shard(self.bias), "tp_i", self.scatter)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"sequences {self.gather} -> {self.scatter}")


class Embedding3D(nn.Module):
    """Token embedding to layout L0: weight (V, D) with V split by (j, then i), D by l.

    Every rank looks the whole micro-batch (B, T) up in its vocabulary block (zeros for
    other tokens): (B, T, D/q), a part of the sum over the q^2 blocks along (i, j).
    Reduce-scattering along i, then along j, completes the sum and leaves sequence
    block (i, j): (B/q^2, T, D/q). Backward: all-gathers along j, then i.
    """

    def __init__(self, embedding: nn.Embedding, grid: Grid):
        super().__init__()
        q = grid.q
        check_embedding(embedding, q * q, grid.mode)
        if embedding.embedding_dim % q:
            raise ValueError(f"3d embedding: width {embedding.embedding_dim} cannot be split {q} ways")
        self.num_embeddings, self.embedding_dim, self.grid = embedding.num_embeddings, embedding.embedding_dim, grid
        self.start = (grid.coord("tp_j") * q + grid.coord("tp_i")) * self.num_embeddings // (q * q)
        self.weight = grid.distribute(embedding.weight, tp_j=Shard(0), tp_i=Shard(0), tp_l=Shard(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        g = self.grid
        batch_block(tokens, g.q * g.q, g.mode)
        partial = lookup(tokens, local_shard(self.weight), self.start)  # (B, T, D/q)
        by_i = reduce_scatter_to_sp(partial, 0, g.along("tp_i"))  # (B/q, T, D/q)
        return reduce_scatter_to_sp(by_i, 0, g.along("tp_j"))  # (B/q^2, T, D/q)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, grid=3d"


ROLES = grid_roles(
    Embedding3D, hidden_axis="tp_l", batch_axes=("tp_i", "tp_j"),
    # Regions stay as they are: attention reads the batch size off its input, so gathering
    # sequences before it (as a column layer does) would have to happen inside it.
    region=lambda m, g: m,
    column=lambda m, g, unit: Linear3D(m, g, gather="tp_j", scatter="tp_l", unit=unit),  # L0 -> L1
    row=lambda m, g: Linear3D(m, g, gather="tp_l", scatter="tp_j"),  # L1 -> L0
    head=lambda m, g: Linear3D(m, g, gather="tp_j", scatter="tp_l"),
)
