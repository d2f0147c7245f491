"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.dropout = nn.Dropout(dropout)  # on the output, before it joins the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, dim) -> (B, T, hidden_dim) -> (B, T, dim)
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))
