"""The feed-forward activations' host operators (backend/host_activations.py): tanh GELU and SwiGLU's
silu(gate) * up, values and gradients against float64 formulas written here, and the fallbacks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from polytrain.backend import host_activations, host_matmul
from polytrain.models.common.mlp import FeedForward

pytestmark = pytest.mark.skipif(not host_matmul.available(), reason="the host kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16]
SIZES = [(3, 1000), (7,), (2, 33, 48)]  # a remainder after whole vectors, less than one vector, 3 dims


@pytest.fixture(autouse=True)
def small_tensors_take_the_operators(monkeypatch):
    """The shapes here are small: below MIN_ELEMENTS models keep torch's ops (see the last test)."""
    monkeypatch.setattr(host_activations, "MIN_ELEMENTS", 1)


def exact_gelu(x: torch.Tensor) -> torch.Tensor:
    """x sigmoid(2u) = 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3), in float64 without
    the cancellation of 1 + tanh u for negative u."""
    x = x.double()
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))


def sample(shape, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(dtype)


def ulps(dtype) -> float:
    return 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
def test_gelu_tanh_and_its_gradient_match_float64(dtype, shape):
    x = sample(shape, dtype)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 30.0, -30.0]).to(dtype)  # flat and saturated ends
    leaf = x.clone().requires_grad_()
    y = host_activations.gelu_tanh(leaf)
    assert y.dtype == dtype and y.shape == x.shape and y.grad_fn is not None
    grad = sample(shape, dtype, seed=1, scale=1.0)
    y.backward(grad)
    x64 = x.double().requires_grad_()
    exact = exact_gelu(x64)
    exact.backward(grad.double())
    # one rounding to the dtype from an fp32 value within a few fp32 ulp (and an absolute floor
    # for values that cancel to near 0)
    tol = dict(rtol=2 * ulps(dtype) if dtype == torch.bfloat16 else 2e-6, atol=1e-6 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(y.double(), exact.detach(), **tol)
    torch.testing.assert_close(leaf.grad.double(), x64.grad, **tol)


def test_gelu_tanh_keeps_the_small_negative_tail_torch_loses():
    x = torch.tensor([-6.0, -8.0, -9.5])
    exact = exact_gelu(x)
    y = host_activations.gelu_tanh(x)
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=0)
    assert (y != 0).all()  # 0.5 x (1 + tanh u) rounds 1 + tanh u to 0 here in fp32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SIZES)
def test_silu_mul_and_its_gradients_match_float64(dtype, shape):
    gate, up = sample(shape, dtype, seed=2), sample(shape, dtype, seed=3)
    g_leaf, u_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = host_activations.silu_mul(g_leaf, u_leaf)
    assert h.dtype == dtype and h.shape == gate.shape
    grad = sample(shape, dtype, seed=4, scale=1.0)
    h.backward(grad)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    exact = g64 * torch.sigmoid(g64) * u64
    exact.backward(grad.double())
    tol = dict(rtol=2 * ulps(dtype) if dtype == torch.bfloat16 else 4e-6, atol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(h.double(), exact.detach(), **tol)
    torch.testing.assert_close(g_leaf.grad.double(), g64.grad, **tol)
    torch.testing.assert_close(u_leaf.grad.double(), u64.grad, **tol)


@pytest.mark.parametrize("op", ["gelu_tanh", "silu_mul"])
def test_results_do_not_depend_on_the_thread_count(op):
    x, y = sample((512, 1024), torch.float32, 5), sample((512, 1024), torch.float32, 6)
    run = (lambda: host_activations.gelu_tanh(x)) if op == "gelu_tanh" else (lambda: host_activations.silu_mul(x, y))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_operands_the_kernels_do_not_take_get_torchs_ops():
    x = sample((4, 64), torch.float32)
    assert host_activations.applies(x)
    strided = x.t()
    assert not host_activations.applies(strided)
    torch.testing.assert_close(host_activations.gelu_tanh(strided), F.gelu(strided, approximate="tanh"))
    half = x.half()
    assert not host_activations.applies(half)
    torch.testing.assert_close(host_activations.silu_mul(half, half), F.silu(half) * half)
    assert not host_activations.applies(x, x[:2])  # shapes differ: torch's broadcasting rules
    torch.testing.assert_close(host_activations.silu_mul(x, x[:1]), F.silu(x) * x[:1])


def test_the_operators_refuse_what_they_cannot_take():
    x = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="operands of one shape"):
        torch.ops.polytrain.silu_mul(x, torch.zeros(4, 9))
    with pytest.raises(RuntimeError, match="every operand in"):
        torch.ops.polytrain.silu_mul(x, x.bfloat16())
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.polytrain.gelu_tanh(x.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.polytrain.gelu_tanh(x.t())


def test_compiled_callers_trace_torchs_ops_without_graph_breaks():
    x = sample((8, 96), torch.float32)
    compiled = torch.compile(lambda a: host_activations.silu_mul(host_activations.gelu_tanh(a), a),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.silu(F.gelu(x, approximate="tanh")) * x)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_feed_forward_equals_its_torch_formula(activation):
    torch.manual_seed(0)
    ff = FeedForward(48, 96, activation=activation, gated=True)
    x = torch.randn(2, 5, 48, requires_grad=True)
    out = ff(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in (x, *ff.parameters())]
    for p in (x, *ff.parameters()):
        p.grad = None
    act = F.silu if activation == "silu" else (lambda a: F.gelu(a, approximate="tanh"))
    reference = ff.w2(act(ff.w1(x)) * ff.w3(x))
    reference.sum().backward()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, [p.grad for p in (x, *ff.parameters())]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_small_activations_keep_torchs_ops(monkeypatch):
    monkeypatch.setattr(host_activations, "MIN_ELEMENTS", 1 << 14)
    decoding = sample((1, 1, 1536), torch.float32)
    assert not host_activations.applies(decoding)
    assert host_activations.applies(sample((16, 1024), torch.float32))
