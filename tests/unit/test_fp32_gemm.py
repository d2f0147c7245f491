"""train.fp32_gemm: fp32 training's forward and input-gradient products on oneDNN (backend.host_gemm.onednn_linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.backend import host_gemm
from polytrain.config import load_config
from polytrain.distributed.linear_cross_entropy import linear_cross_entropy
from polytrain.errors import ConfigError
from polytrain.train.chunked_loss import LossHead
from polytrain.train.fp32_gemm import linears_on_onednn, wanted
from polytrain.train.trainer import Trainer
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.skipif(not host_gemm.onednn_available(), reason="this build of torch has no oneDNN")


def _operands(bias=True, batch=(3, 40)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*batch, 96, generator=gen).requires_grad_()
    w = (torch.randn(72, 96, generator=gen) * 0.1).requires_grad_()
    b = torch.randn(72, generator=gen).requires_grad_() if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [True, False])
def test_products_and_gradients_equal_f_linears(bias):
    x, w, b = _operands(bias)
    out = host_gemm.onednn_linear(x, w, b)
    assert out.grad_fn is not None and "OneDnn" in type(out.grad_fn).__name__  # it took the oneDNN path
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], grad)
    ref_out = F.linear(x, w, b)
    want = torch.autograd.grad(ref_out, [t for t in (x, w, b) if t is not None], grad)
    # fp32 sums in another order: a few ulp of the magnitudes summed
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_a_transposed_weight_is_read_in_place():
    x, w, _ = _operands(bias=False)
    wt = w.detach().t().contiguous()  # (in, out): w.t() of it is the (out, in) weight, strided
    torch.testing.assert_close(host_gemm.onednn_linear(x.detach(), wt.t()), F.linear(x.detach(), w.detach()),
                               rtol=1e-5, atol=1e-5)


def test_what_onednn_does_not_take_runs_f_linear():
    x, w, b = _operands()
    for args in ((x.bfloat16(), w.bfloat16(), b.bfloat16()),  # not fp32
                 (x.transpose(0, 1), w, b),  # not contiguous
                 (x[0, :host_gemm.MIN_ONEDNN_ROWS - 1], w, b)):  # a decoding step's few rows
        out = host_gemm.onednn_linear(*args)
        assert "OneDnn" not in type(out.grad_fn).__name__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert host_gemm.onednn_linear(x, w, b).dtype == torch.bfloat16  # autocast's F.linear


def test_a_compiled_block_keeps_the_onednn_products_with_their_gradients():
    """Inductor would run F.linear's products on the BLAS: the block holds oneDNN's operator instead,
    forward and input gradient, with no graph break."""
    from torch._dynamo.testing import CompileCounterWithBackend

    x, w, b = _operands()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(host_gemm.onednn_linear, backend=counter, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]  # leaves, so .grad is filled
    compiled(*leaves).square().sum().backward()
    reference = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    F.linear(*reference).square().sum().backward()
    for got, want in zip(leaves, reference):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-5)
    graph = "\n".join(g.print_readable(print_output=False) for g in counter.graphs)  # with the fwd / bwd bodies
    assert counter.frame_count == 1 and "polytrain.onednn_linear" in graph


def test_auto_follows_the_blas_and_other_precisions_and_devices_keep_it(monkeypatch):
    monkeypatch.setattr(host_gemm, "blas_is_generic", lambda: True)
    assert wanted("auto", torch.float32, "cpu") and wanted("onednn", torch.float32, "cpu")
    assert not wanted("blas", torch.float32, "cpu")
    assert not wanted("auto", torch.bfloat16, "cpu") and not wanted("auto", torch.float32, "cuda")
    monkeypatch.setattr(host_gemm, "blas_is_generic", lambda: False)
    assert not wanted("auto", torch.float32, "cpu") and wanted("onednn", torch.float32, "cpu")
    monkeypatch.setattr(host_gemm, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="no oneDNN"):
        wanted("onednn", torch.float32, "cpu")


def test_the_blas_is_judged_by_the_cpus_maker():
    host_gemm.blas_is_generic.cache_clear()
    try:
        vendor = host_gemm.blas_is_generic()
        with open("/proc/cpuinfo") as f:
            maker = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
        if torch.backends.mkl.is_available() and maker:
            assert vendor == (maker != "GenuineIntel")
    finally:
        host_gemm.blas_is_generic.cache_clear()


def test_plain_linears_the_loss_head_and_own_products_are_routed():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8)
            self.head = LossHead.replacing(nn.Linear(8, 16))
            self.norm = nn.LayerNorm(8)

    net = Net()
    assert linears_on_onednn(net) == 2
    assert "forward" in net.inner.__dict__ and net.head.chunk_product is host_gemm.onednn_linear
    assert "forward" not in net.norm.__dict__


def test_the_chunked_losss_products_through_onednn_give_its_loss_and_gradients():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(300, 48, generator=gen, requires_grad=True)
    weight = (torch.randn(500, 48, generator=gen) * 0.2).requires_grad_()
    targets = torch.randint(0, 500, (300,), generator=gen)
    results = []
    for product in (None, host_gemm.onednn_linear):
        loss = linear_cross_entropy(hidden, weight, None, targets, chunk=128, product=product)
        results.append((loss, *torch.autograd.grad(loss, [hidden, weight])))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fp32_training_on_onednn_follows_the_blas_run(small_corpus, tmp_path):
    runs = {}
    for setting in ("blas", "onednn"):
        trainer = Trainer(load_config(None, tiny_overrides(small_corpus, tmp_path / setting,
                                                           **{"train.fp32_gemm": setting})))
        runs[setting] = ([trainer.train_step()["loss"] for _ in range(3)], trainer.describe())
        trainer.close()
    assert "(products on oneDNN)" in runs["onednn"][1] and "oneDNN" not in runs["blas"][1]
    torch.testing.assert_close(runs["onednn"][0], runs["blas"][0], rtol=1e-5, atol=0)
