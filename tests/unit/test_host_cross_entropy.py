"""The chunked loss's host operators (backend/host_cross_entropy.py): log-sum-exp and softmax gradient
against float64, and the chunked loss giving the same loss and gradients with them as without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polytrain.backend import host_cross_entropy, host_matmul
from polytrain.distributed import linear_cross_entropy as lce

pytestmark = pytest.mark.skipif(not host_matmul.available(), reason="the host kernels cannot be built here")


def chunk(C, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(C, V, generator=g)).to(dtype)
    target = torch.randint(0, V, (C, 1), generator=g)
    hit = torch.rand(C, generator=g) < 0.8
    target = torch.where(hit[:, None], target, 0)
    return logits, target, hit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [4096, 1000, 7])  # whole vectors, a remainder, less than one vector
def test_lse_and_target_sum_match_float64(dtype, V):
    logits, target, hit = chunk(37, V, dtype)
    lse, target_sum = host_cross_entropy.chunk_lse(logits, target, hit)
    exact = logits.double().logsumexp(-1)
    torch.testing.assert_close(lse.double(), exact, rtol=2e-6, atol=2e-6)
    exact_sum = (logits.double().gather(1, target).squeeze(1) * hit).sum()
    torch.testing.assert_close(target_sum.double(), exact_sum, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_is_softmax_minus_one_hot_rounded_once(dtype):
    logits, target, hit = chunk(40, 1000, dtype)
    keep = hit.clone()
    keep[:3] = True  # scored, target on another rank: no -1 here
    keep[-2:] = False  # not scored: zero rows
    hit = hit & keep
    lse = logits.double().logsumexp(-1).float()
    grad = host_cross_entropy.chunk_grad(logits, lse, target, hit, keep)
    assert grad.dtype == dtype and grad.shape == logits.shape
    exact = (logits.double() - lse.double()[:, None]).exp()
    exact.scatter_add_(1, target, -hit[:, None].double())
    exact[~keep] = 0
    # one rounding to the dtype from an fp32 value within ~2 ulp of the exact one
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(grad.double(), exact, rtol=2 * ulp, atol=1e-7)
    assert not grad[~keep].any()


def test_a_target_outside_the_rows_is_refused():
    logits = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="is not one of the 8 vocabulary rows"):
        torch.ops.polytrain.chunk_lse(logits, torch.tensor([1, 8]), torch.tensor([True, True]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_is_the_same_with_and_without_them(monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(300, 48, generator=g).to(dtype)
    weight = (0.2 * torch.randn(500, 48, generator=g)).to(dtype)
    targets = torch.randint(0, 500, (300,), generator=g)
    targets[::7] = lce.IGNORE_INDEX

    def loss_and_grads():
        lce._kernels.cache_clear()
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = lce.linear_cross_entropy(h, w, None, targets, chunk=128)
        loss.backward()
        return loss, h.grad, w.grad

    calls = []
    real = host_cross_entropy.chunk_grad
    monkeypatch.setattr(host_cross_entropy, "chunk_grad", lambda *a: calls.append(1) or real(*a))
    with_ops = loss_and_grads()
    assert len(calls) == 3  # 300 tokens in chunks of 128
    monkeypatch.setattr(host_cross_entropy, "applies", lambda logits: False)
    without = loss_and_grads()
    lce._kernels.cache_clear()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for a, b in zip(with_ops, without):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max().item())
    plain = F.cross_entropy(F.linear(hidden.float(), weight.float()), targets)
    torch.testing.assert_close(with_ops[0].float(), plain, rtol=tol, atol=tol)
