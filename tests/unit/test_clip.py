"""Clipping over gradient shards: the norm of the pieces is the norm of the whole, as torch computes it."""

from __future__ import annotations

import math

import pytest
import torch

from polytrain.optim.clip import clip_coefficient, sharded_grad_norm


def test_norm_of_pieces_and_coefficient_match_torch():
    grads = [torch.randn(7, 3, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(4)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    # The same gradients cut into row pieces, as ranks would hold them.
    pieces = [piece for g in grads for piece in g.chunk(3)]
    norm = sharded_grad_norm(pieces, group=None, device=torch.device("cpu"))
    assert norm.item() == pytest.approx(ref.item(), rel=1e-6)
    coef = clip_coefficient(norm, 1.0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * coef, p.grad)
    assert clip_coefficient(norm, math.inf).item() == 1.0
    assert clip_coefficient(norm, 10 * norm.item()).item() == 1.0


def test_a_rank_without_gradients_adds_zero():
    assert sharded_grad_norm([], group=None, device=torch.device("cpu")).item() == 0.0
