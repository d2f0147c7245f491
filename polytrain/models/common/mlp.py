"""Feed-forward blocks: plain (GPT-2, BERT, T5 v1.0) and gated (SwiGLU, T5 v1.1's gated GELU)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.backend.host_activations import gelu_tanh, silu_mul

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact, with erf (BERT)
    "gelu_tanh": gelu_tanh,  # GPT-2's and T5's "gelu_new": F.gelu(approximate="tanh"), on the host in one pass
    "relu": F.relu,
}
GATED_PRODUCTS = {"silu": silu_mul}
"""act(gate) * up in one pass (on the host; torch's ops elsewhere), where one is written."""


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x) when gated, else w2(act(w1 x)).

    w1 is the gate (gated) or up projection, w3 the up projection, w2 the down
    projection: w1 and w3 split by output rows and w2 by input columns under tensor
    parallelism.
    """

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu", gated: bool = True,
                 bias: bool = False, dropout: float = 0.0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias) if gated else None
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)  # on the output, before it joins the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, dim) -> (B, T, hidden_dim) -> (B, T, dim)
        if self.w3 is None:
            h = ACTIVATIONS[self.activation](self.w1(x))
        elif self.activation in GATED_PRODUCTS:
            h = GATED_PRODUCTS[self.activation](self.w1(x), self.w3(x))
        else:
            h = ACTIVATIONS[self.activation](self.w1(x)) * self.w3(x)
        return self.dropout(self.w2(h))

