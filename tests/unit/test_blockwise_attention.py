"""The blockwise (online-softmax) attention kernel against torch's SDPA, in float64.

The reference is F.scaled_dot_product_attention with an explicit boolean mask and the
key/value heads repeated; the kernel under test never builds that mask or repeats heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from polytrain.models.common.blockwise_attention import (
    Visibility,
    attention_backward,
    attention_forward,
    blockwise_attention,
)

F64 = torch.float64


def _qkv(B=2, H=4, Hkv=2, Tq=29, Tk=29, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, dtype=F64, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, Tk, D, dtype=F64, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, Tk, D, dtype=F64, generator=g).requires_grad_()
    return q, k, v


def _docs(B, T, seed=1):
    """(B, T) ids of packed documents of random lengths (row 0 several, row 1 one document)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(T, generator=g) < 0.2
    row0 = starts.long().cumsum(0)
    return torch.stack([row0] + [torch.full((T,), 7)] * (B - 1))


def _reference(q, k, v, vis: Visibility, scale=None):
    """SDPA with the mask `vis` describes, built whole, and the KV heads repeated."""
    allowed = torch.ones(q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool)
    if vis.causal:
        allowed = allowed & (vis.k_slots[None, :] <= vis.q_slots[:, None])
    if vis.q_docs is not None:
        allowed = allowed & (vis.q_docs[:, None, :, None] == vis.k_docs[:, None, None, :])
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=allowed, scale=scale)


def _check(q, k, v, vis, block, scale=None):
    out = blockwise_attention(q, k, v, vis, scale, block)
    ref = _reference(q, k, v, vis, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_matches_sdpa_with_causal_document_masks_and_gqa(causal, packed, n_kv):
    q, k, v = _qkv(Hkv=n_kv)
    docs = _docs(2, 29) if packed else None
    vis = Visibility.of_sequence(29, 29, causal, q.device, docs)
    _check(q, k, v, vis, block=6)  # 29 = 4 x 6 + 5: an uneven last tile


def test_queries_after_a_prefix_and_a_custom_scale():
    """Tq < Tk: the queries are the last slots (as after a KV cache prefix)."""
    q, k, v = _qkv(Tq=7, Tk=20)
    vis = Visibility.of_sequence(7, 20, True, q.device, _docs(2, 20))
    _check(q, k, v, vis, block=4, scale=0.3)


def test_any_order_of_slots():
    """A shard holding slots in any order (zigzag chunks, several shards' keys) gets the same rows."""
    q, k, v = _qkv(Tq=24, Tk=24, seed=3)
    perm = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    docs = _docs(2, 24)[:, perm]
    vis = Visibility(True, perm, perm, docs, docs)
    _check(q, k, v, vis, block=5)


def test_log_sum_exp_and_queries_that_see_nothing():
    q, k, v = _qkv(Tq=6, Tk=9)
    # Queries at slots 0..5, keys at 3..11: the first three queries see no key at all.
    vis = Visibility(True, torch.arange(6), torch.arange(3, 12))
    out, lse = attention_forward(q, k, v, vis, 0.5, block=4)
    scores = 0.5 * q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    scores = scores.masked_fill(~(vis.k_slots[None, :] <= vis.q_slots[:, None]), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    dq, dk, dv = attention_backward(q, k, v, out, lse, torch.ones_like(out), vis, 0.5, block=4)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :, :3], torch.zeros_like(dq[:, :, :3]))


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_builds_a_sequence_by_sequence_tensor():
    T, block = 256, 32
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(B=1, H=2, Hkv=1, Tq=T, Tk=T))
    vis = Visibility.of_sequence(T, T, True, q.device, _docs(1, T))
    with _LargestTensor() as spy:
        blockwise_attention(q, k, v, vis, None, block).sum().backward()
    per_head_scores = T * T
    assert spy.largest < per_head_scores / 4, spy.largest  # tiles: 2 heads x 32 x 32 = 2,048
    with _LargestTensor() as sdpa:
        _reference(q, k, v, vis).sum().backward()
    assert sdpa.largest >= per_head_scores  # the spy does see a (T, T) matrix when there is one
