"""train.matmul_fp32: 16-bit products run as fp32 GEMMs on the widened operands, rounded back."""

from __future__ import annotations

import platform
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.backend import Peak, host_gemm
from polytrain.config import load_config
from polytrain.distributed.linear_cross_entropy import linear_cross_entropy
from polytrain.errors import ConfigError
from polytrain.inference.threaded_matmul import threaded_linears
from polytrain.lora import LoRALinear
from polytrain.train.chunked_loss import LossHead
from polytrain.train.matmul_fp32 import linears_in_fp32, wanted
from polytrain.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.gemm_dtypes import GemmDtypes


def _operands(dtype=torch.bfloat16, bias=True):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 96, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(72, 96, generator=gen) * 0.1).to(dtype).requires_grad_()
    b = torch.randn(72, generator=gen).to(dtype).requires_grad_() if bias else None
    return x, w, b


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                         terms: int) -> bool:
    """|got - exact| within one rounding to `dtype` plus fp32 summation's error bound over `terms`
    products whose absolute sum is `magnitude` (where terms cancel, fp32's error can pass dtype's
    spacing at the small result)."""
    spacing = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
    fp32_sums = terms * torch.finfo(torch.float32).eps * magnitude
    return bool(((got.double() - exact).abs() <= spacing + fp32_sums).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_and_gradients_are_the_exact_ones_rounded_once(dtype):
    x, w, b = _operands(dtype)
    out = host_gemm.linear(x, w, b, dtype)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad_out)
    assert out.dtype == dtype and x.grad.dtype == w.grad.dtype == b.grad.dtype == dtype
    # float64 from the same 16-bit operands: the products' exact sums, then one rounding.
    x64, w64, dy64, b64 = x.detach().double(), w.detach().double(), grad_out.double(), b.detach().double()
    checks = ((out, x64 @ w64.t() + b64, x64.abs() @ w64.abs().t() + b64.abs(), 96),
              (x.grad, dy64 @ w64, dy64.abs() @ w64.abs(), 72),
              (w.grad, dy64.flatten(0, 1).t() @ x64.flatten(0, 1), dy64.flatten(0, 1).abs().t() @ x64.flatten(0, 1).abs(), 120),
              (b.grad, dy64.sum((0, 1)), dy64.abs().sum((0, 1)), 120))
    for got, exact, magnitude, terms in checks:
        assert _within_one_rounding(got.detach(), exact, magnitude, dtype, terms)


def test_autocast_operands_are_rounded_as_autocast_rounds_them():
    x, w, b = _operands(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = host_gemm.linear(x, w, b, torch.bfloat16)
        plain = F.linear(x, w, b)  # autocast's own 16-bit GEMM
    assert out.dtype == plain.dtype == torch.bfloat16
    x64, w64, b64 = (t.detach().bfloat16().double() for t in (x, w, b))
    assert _within_one_rounding(out.detach(), x64 @ w64.t() + b64, x64.abs() @ w64.abs().t() + b64.abs(),
                                torch.bfloat16, 96)
    out.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32  # through the casts to the fp32 leaves


def test_a_backward_inside_autocast_still_runs_fp32_gemms():
    x, w, b = _operands()
    with torch.autocast("cpu", dtype=torch.bfloat16), GemmDtypes() as gemms:
        host_gemm.linear(x, w, b, torch.bfloat16).float().sum().backward()  # the backward under autocast too
    assert gemms.seen == {torch.float32: 3}  # forward, dx, dW


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86 Linux flags")
def test_emulation_is_read_from_the_cpu_flags():
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split())
    assert host_gemm.emulates(torch.bfloat16) == (not flags & {"avx512_bf16", "amx_bf16"})
    assert host_gemm.emulates(torch.float16) == ("amx_fp16" not in flags)
    assert not host_gemm.emulates(torch.float32)


def test_auto_follows_the_host_and_fp32_models_have_nothing_to_widen():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert wanted("auto", bf16, "cpu") == host_gemm.emulates(bf16)
    assert not wanted("auto", bf16, "cuda") and wanted("true", bf16, "cuda")
    assert not wanted("false", fp16, "cpu") and not wanted("true", fp32, "cpu")
    with pytest.raises(ConfigError, match="matmul_fp32"):
        load_config(None, ["--train.matmul_fp32", "true"])  # fp32 training


def test_plain_linears_and_the_loss_head_change_and_nothing_else():
    class Sub(nn.Linear):  # a subclass with its own forward (as LoRA's) keeps it
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), Sub(4, 4), nn.Sequential(nn.Linear(4, 4)))
    model.output = LossHead.replacing(nn.Linear(4, 8))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert linears_in_fp32(model) == 3
    assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__
    assert model.output.matmul_dtype == torch.float32 and "forward" not in model.output.__dict__
    assert model.state_dict().keys() == state.keys()


def test_lora_layers_run_base_and_adapter_products_in_fp32(monkeypatch):
    seen = []

    def spy(x, w, b=None):
        seen.append((x.dtype, w.dtype))
        return F.linear(x, w, b)

    monkeypatch.setattr(host_gemm, "F", types.SimpleNamespace(linear=spy))
    base = nn.Linear(96, 72).bfloat16()
    layer = LoRALinear(base, rank=4, alpha=8)
    with torch.no_grad():
        layer.lora_b.normal_()
        layer.lora_a.normal_()
    x = _operands()[0]
    plain = layer(x)
    assert linears_in_fp32(layer) == 1 and layer.product is not F.linear
    widened = layer(x)
    assert seen == [(torch.float32, torch.float32)] * 3  # base, x a^T, (x a^T) b^T
    torch.testing.assert_close(widened, plain, rtol=2 ** -7, atol=2 ** -6)  # bf16 roundings apart
    widened.float().sum().backward()
    assert layer.lora_a.grad.dtype == layer.lora_b.grad.dtype == torch.bfloat16


def test_an_fp32_layer_keeps_f_linear():
    layer = nn.Linear(8, 4)
    linears_in_fp32(layer)
    x = torch.randn(2, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_the_loss_heads_fp32_products_give_the_exact_loss():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(200, 32, generator=gen) * 0.3).bfloat16().requires_grad_()
    targets = torch.randint(0, 200, (64,), generator=gen)
    exact = F.cross_entropy(hidden.detach().double() @ weight.detach().double().t(), targets)
    losses = {}
    for dtype in (None, torch.float32):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # an fp32 product must not be rounded by it
            losses[dtype] = linear_cross_entropy(hidden, weight, None, targets, chunk=16, matmul_dtype=dtype)
    assert abs(losses[torch.float32].item() - exact.item()) < 1e-5 * exact.item()  # fp32 logits
    assert abs(losses[None].item() - exact.item()) > abs(losses[torch.float32].item() - exact.item())
    losses[torch.float32].backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_decoding_kernels_take_over_and_give_the_forward_back():
    layer = nn.Linear(64, 48).bfloat16()
    linears_in_fp32(layer)
    mine = layer.__dict__["forward"]
    with torch.no_grad(), threaded_linears(layer, rows=8) as changed:
        if changed:  # the host kernel built here
            assert layer.__dict__["forward"] is not mine
        prompt = layer(torch.randn(16, 64).bfloat16())  # more rows than decoding's: the forward it had
    assert layer.__dict__["forward"] is mine
    assert prompt.dtype == torch.bfloat16


def _losses(corpus, run_dir, **extra):
    trainer = Trainer(load_config(None, tiny_overrides(corpus, run_dir, **{"train.precision": "bf16", **extra})))
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    header, timer = trainer.describe(), trainer.compile_timer
    trainer.close()
    return losses, header, timer


def test_bf16_training_with_fp32_products_follows_the_bf16_run(small_corpus, tmp_path):
    plain, header, _ = _losses(small_corpus, tmp_path / "plain", **{"train.matmul_fp32": "false"})
    widened, widened_header, _ = _losses(small_corpus, tmp_path / "widened", **{"train.matmul_fp32": "true"})
    assert "fp32 GEMMs" in widened_header and "fp32 GEMMs" not in header
    assert widened != plain  # the products really ran otherwise
    torch.testing.assert_close(widened, plain, rtol=1e-2, atol=0)  # within bf16's rounding of a few steps
    torch._dynamo.reset()  # count this run's graphs: an earlier test's identical ones would be reused
    compiled, _, timer = _losses(small_corpus, tmp_path / "compiled", **{"train.matmul_fp32": "true",
                                                                         "train.compile": True})
    assert timer.breaks == 0 and timer.graphs == 1 + 2  # the blocks still share one graph
    torch.testing.assert_close(compiled, widened, rtol=1e-2, atol=0)


def test_mfu_and_the_planner_hold_widened_products_to_fp32s_peak(monkeypatch):
    """With products run as fp32 GEMMs, a bf16 run's MFU divides by fp32's peak (the emulated bf16
    GEMM's, a third of it or less, gave MFUs over 100%), and the planner rates bf16 at fp32's."""
    from polytrain.backend import flops
    from polytrain.plan.devices import measured_cpu

    peaks = {torch.float32: 100.0, torch.bfloat16: 20.0, torch.float16: 10.0}
    acc = types.SimpleNamespace(peak=lambda dtype: Peak(peaks[dtype], str(dtype), "a stand-in's"))
    trainer = types.SimpleNamespace(acc=acc, autocast_dtype=torch.bfloat16)
    for fp32_matmuls, peak in ((True, 100.0), (False, 20.0)):
        trainer.fp32_matmuls = fp32_matmuls
        assert Trainer._mfu_meter(trainer).of(5.0) == (5.0 / peak, None)

    monkeypatch.setattr(flops, "cpu_peak_flops", peaks.get)
    for emulated in (True, False):
        monkeypatch.setattr(host_gemm, "emulates", lambda dtype: emulated)
        rates = measured_cpu().peak_flops
        assert rates["bf16"] / rates["fp32"] == (1.0 if emulated else 0.2)
