"""Root-mean-square layer norm."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back to the input dtype.

    Low-precision inputs lose too much in the mean of squares, so the reduction
    always runs in fp32 whatever the autocast or parameter dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (..., dim)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)
