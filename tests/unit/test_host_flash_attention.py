"""The host CPU's flash-attention kernel (backend/host_flash_attention.py) and its use in training
(train/host_attention.py): outputs and gradients against a float64 softmax written out here."""

from __future__ import annotations

import pytest
import torch

from polytrain.backend import host_flash_attention, host_matmul
from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.models.common.attention import Attention
from polytrain.train import host_attention
from polytrain.train.trainer import Trainer
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.skipif(not host_matmul.available(), reason="the host kernels cannot be built here")


def reference(q, k, v, causal, scale):
    """softmax(scale q k^T) v in float64, each query head reading its group's key/value head."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = scale * q.double() @ k.transpose(-1, -2)  # (B, H, T, S)
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def inputs(B, H, Hkv, T, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the model makes it: (B, T, H, D) projections seen as (B, H, T, D)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(B, H, T, D, generator=g).to(dtype)
    return q, k, v, grad


SHAPES = [  # B, H, Hkv, T, S, D, causal: blocks of 64 whole and cut, grouped heads, every head size
    (2, 6, 2, 128, 128, 32, True),
    (1, 4, 4, 100, 100, 64, True),
    (3, 3, 3, 65, 65, 32, True),
    (2, 2, 1, 70, 130, 16, False),
    (1, 4, 2, 129, 40, 64, False),
    (1, 2, 2, 90, 90, 128, True),
    (1, 2, 1, 33, 33, 256, True),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_output_and_gradients_match_float64(shape):
    B, H, Hkv, T, S, D, causal = shape
    if D not in host_flash_attention._head_dims:
        pytest.skip(f"head size {D} is not one this CPU's vectors take")
    q, k, v, grad = inputs(B, H, Hkv, T, S, D, torch.float32)
    out = host_flash_attention.flash_attention(q, k, v, causal, scale=0.3)
    assert out is not None and out.shape == (B, H, T, D) and out.dtype == torch.float32
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, causal, 0.3)
    expected.backward(grad.double())
    for got, want in ((out, expected), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bf16_is_as_close_to_float64_as_torchs_own_bf16_attention():
    B, H, Hkv, T, D = 2, 4, 2, 160, 32
    q, k, v, grad = inputs(B, H, Hkv, T, T, D, torch.bfloat16)
    out = host_flash_attention.flash_attention(q, k, v, True)
    out.backward(grad)
    assert out.dtype == q.grad.dtype == k.grad.dtype == torch.bfloat16
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, True, D ** -0.5)
    expected.backward(grad.double())
    qt, kt, vt = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch_out = torch.nn.functional.scaled_dot_product_attention(qt, kt.repeat_interleave(2, 1),
                                                                 vt.repeat_interleave(2, 1), is_causal=True)
    torch_out.backward(grad)
    for ours, theirs, want in ((out, torch_out, expected), (q.grad, qt.grad, q64.grad), (k.grad, kt.grad, k64.grad),
                               (v.grad, vt.grad, v64.grad)):
        our_error = (ours.double() - want).abs().max().item()
        their_error = (theirs.double() - want).abs().max().item()
        assert our_error <= 1.25 * their_error + 1e-6 * want.abs().max().item()


def test_results_do_not_depend_on_the_thread_count():
    q, k, v, grad = inputs(2, 4, 2, 200, 200, 32, torch.float32)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t in (q, k, v):
                t.grad = None
            out = host_flash_attention.flash_attention(q, k, v, True)
            out.backward(grad)
            results.append([out.detach(), q.grad, k.grad, v.grad])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_the_output_is_laid_out_for_the_projection_that_follows():
    q, k, v, _ = inputs(2, 4, 4, 64, 64, 32, torch.float32)
    out = host_flash_attention.flash_attention(q, k, v, True)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, D) memory: the reshape to (B, T, H * D) is a view


def test_it_declines_what_it_does_not_cover():
    q, k, v, _ = inputs(1, 2, 2, 16, 16, 32, torch.float32)
    assert host_flash_attention.flash_attention(q.half(), k.half(), v.half(), True) is None  # fp16
    assert host_flash_attention.flash_attention(q, k[:, :, :8], v[:, :, :8], True) is None  # causal, T != S
    assert host_flash_attention.flash_attention(q[..., :24], k[..., :24], v[..., :24], False) is None  # head size
    assert host_flash_attention.flash_attention(q, k.to("meta"), v, False) is None  # another device
    three = torch.zeros(1, 3, 16, 32)
    assert host_flash_attention.flash_attention(three, k, v, False) is None  # 3 query heads over 2 kv heads


def test_the_operator_refuses_bad_shapes_with_a_message():
    q = torch.zeros(1, 2, 8, 32)
    with pytest.raises(RuntimeError, match="causal mask needs as many queries as keys"):
        torch.ops.polytrain.flash_attention(q, q[:, :, :4], q[:, :, :4], True, 1.0)
    with pytest.raises(RuntimeError, match="head size"):
        torch.ops.polytrain.flash_attention(q[..., :24], q[..., :24], q[..., :24], False, 1.0)


def test_compiled_it_is_one_graph_and_matches_eager():
    q, k, v, grad = inputs(1, 4, 2, 96, 96, 32, torch.float32)

    def step(q, k, v):
        return host_flash_attention.flash_attention(q, k, v, True, None) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    out.backward(grad)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = step(q, k, v)
    eager.backward(grad)
    assert torch.equal(out, eager)
    for got, t in zip(grads, (q, k, v)):
        assert torch.equal(got, t.grad)


# ----- in training ------------------------------------------------------------------------


def test_each_layer_tries_the_kernel_then_keeps_its_own_core():
    layer = Attention(64, 4, 2, 0)
    calls = []
    original = layer.core
    layer.core = host_attention.on_kernel(layer, lambda q, k, v, mask: calls.append(mask) or original(q, k, v, mask))
    x = torch.randn(2, 16, 64)
    layer(x)
    assert calls == []  # no mask, causal: the kernel
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    layer(x, mask=mask)
    assert len(calls) == 1  # a mask: the layer's own core
    layer.dropout = 0.1
    layer.train()
    layer(x)
    assert len(calls) == 2  # attention dropout in training: its own core


def test_auto_takes_fp32_everywhere_and_bf16_up_to_512_tokens_on_a_cpu_with_bf16_instructions(monkeypatch):
    monkeypatch.setattr(host_attention.host_gemm, "emulates", lambda dtype: False)
    wanted = host_attention.wanted
    assert wanted("auto", torch.float32, "cpu", {32}, 8192)
    assert wanted("auto", torch.bfloat16, "cpu", {64}, 512)
    assert not wanted("auto", torch.bfloat16, "cpu", {64}, 1024)
    assert wanted("true", torch.bfloat16, "cpu", {64}, 2048)
    assert not wanted("auto", torch.float16, "cpu", {64}, 256)
    assert not wanted("auto", torch.float32, "cuda", {64}, 256)
    assert not wanted("false", torch.float32, "cpu", {64}, 256)
    assert not wanted("auto", torch.float32, "cpu", {24}, 256)  # no head size it takes
    monkeypatch.setattr(host_attention.host_gemm, "emulates", lambda dtype: dtype == torch.bfloat16)
    assert wanted("auto", torch.bfloat16, "cpu", {64}, 8192)


def _losses(corpus, run_dir, **extra):
    trainer = Trainer(load_config(None, tiny_overrides(corpus, run_dir, **extra)))
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    on = trainer.host_attention
    trainer.close()
    return losses, weights, on


def test_fp32_training_on_the_kernel_matches_sdpa(small_corpus, tmp_path):
    sdpa, sdpa_weights, off = _losses(small_corpus, tmp_path / "sdpa", **{"train.host_attention": "false"})
    kernel, kernel_weights, on = _losses(small_corpus, tmp_path / "kernel", **{"train.host_attention": "true"})
    assert on and not off
    assert kernel == pytest.approx(sdpa, rel=1e-5)
    # The kernel ran: its sums go in another order, so some weight differs in its last bits after 3 steps.
    assert any(not torch.equal(kernel_weights[name], w) for name, w in sdpa_weights.items())
    # Adam's normalised steps turn rounding-level gradient differences into up to a few percent of a
    # step (lr 3e-3) where a gradient is near zero: weights agree to well within one step.
    for name, w in sdpa_weights.items():
        torch.testing.assert_close(kernel_weights[name], w, rtol=1e-3, atol=1e-4)


def test_true_is_refused_where_it_cannot_run(small_corpus, tmp_path):
    with pytest.raises(ConfigError, match="train.host_attention = true"):
        Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path, **{"train.host_attention": "true",
                                                                           "train.precision": "fp16"})))
