"""train.attention_fp32: the attention core in fp32 inside 16-bit training, its output cast back."""

from __future__ import annotations

import math

import pytest
import torch

from polytrain.backend import host_gemm
from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.models.common.attention import Attention
from polytrain.train.attention_fp32 import attention_in_fp32, in_fp32
from polytrain.train.build import fp32_attention
from polytrain.train.trainer import Trainer
from tests.conftest import tiny_overrides


def _causal_attention_f64(q, k, v):
    """softmax(q k^T / sqrt(D) + causal mask) v in float64, written out: (B, H, T, D)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


def test_the_core_runs_in_fp32_and_returns_the_16_bit_dtype():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    layer = Attention(64, 4, 4, 0)
    seen = []

    def spy(q, k, v, mask):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled(q.device.type)))
        return layer.core(q, k, v, mask)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the trainer runs 16-bit steps
        out = in_fp32(spy)(q, k, v, None)
    assert seen == [(torch.float32, torch.float32, torch.float32, False)] and out.dtype == torch.bfloat16
    exact = _causal_attention_f64(q, k, v)
    fp32_error = (out.detach().double() - exact).abs().max()
    bf16_error = (layer.core(q, k, v, None).detach().double() - exact).abs().max()
    assert fp32_error <= 2 ** -8 * exact.abs().max()  # only the output's rounding to bf16
    assert fp32_error <= bf16_error


def test_an_additive_mask_is_upcast_with_the_inputs():
    q = k = v = torch.ones(1, 2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(1, 2, 3, 3, dtype=torch.bfloat16)
    dtypes = []
    in_fp32(lambda q, k, v, mask: dtypes.append(mask.dtype) or q)(q, k, v, bias)
    assert dtypes == [torch.float32]


def test_every_attention_layer_is_wrapped_and_parameters_are_untouched():
    from tests.models.test_zoo import make

    model = make("llama")
    names = [name for name, _ in model.named_parameters()]
    count = attention_in_fp32(model)
    assert count == sum(isinstance(m, Attention) for m in model.modules()) > 0
    assert [name for name, _ in model.named_parameters()] == names
    assert all("core" in m.__dict__ for m in model.modules() if isinstance(m, Attention))


def test_it_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(None, ["--train.attention_fp32", "true"])  # fp32 training: nothing to upcast
    for where in (["--parallel.cp", "2"], ["--data.packed_documents", "true"]):
        with pytest.raises(ConfigError, match="parallel.cp > 1 or data.packed_documents"):
            load_config(None, ["--train.attention_fp32", "true", "--train.precision", "bf16", *where])
        load_config(None, ["--train.precision", "bf16", *where])  # auto: simply off there
    with pytest.raises(ConfigError, match="is not one of 'auto', 'true', 'false'"):
        load_config(None, ["--train.attention_fp32", "yes"])


def _wants(overrides: list[str], device: str = "cpu", cp=None) -> bool:
    """fp32_attention for the model and train settings `overrides` give, built on the meta device."""
    from polytrain.models import ARCHITECTURES

    cfg = load_config(None, ["--model.size", "tiny", "--train.precision", "bf16", *overrides])
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.model.arch].build(cfg.model)
    return fp32_attention(cfg, model, torch.device(device), cp)


def test_auto_upcasts_narrow_heads_at_short_sequences_on_a_cpu_with_16_bit_instructions(monkeypatch):
    monkeypatch.setattr(host_gemm, "emulates", lambda dtype: False)
    narrow = ["--model.dim", "192", "--model.n_heads", "6", "--data.seq_len", "256"]  # 32-wide heads
    assert _wants(narrow)
    assert not _wants(narrow, device="meta")  # not a CPU: its 16-bit kernels are the fast ones
    assert not _wants(["--model.dim", "256", "--model.n_heads", "4", "--data.seq_len", "256"])  # 64-wide
    assert not _wants(["--model.dim", "192", "--model.n_heads", "6", "--data.seq_len", "1024"])  # long
    assert not _wants([*narrow, "--train.precision", "fp32"])  # an fp32 RLHF role: nothing to upcast
    assert not _wants([*narrow, "--train.attention_fp32", "false"])
    assert not _wants(narrow, cp=object())  # context parallelism exchanges k and v in 16 bits
    assert _wants(["--model.dim", "256", "--model.n_heads", "4", "--data.seq_len", "1024",
                   "--train.attention_fp32", "true"])  # forced on


def test_auto_upcasts_every_shape_where_the_cpu_emulates_the_16_bit_gemms(monkeypatch):
    wide_and_long = ["--model.dim", "256", "--model.n_heads", "4", "--data.seq_len", "1024"]  # 64-wide heads
    for precision in ("bf16", "fp16"):
        emulated = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        monkeypatch.setattr(host_gemm, "emulates", lambda dtype: dtype == emulated)
        assert _wants([*wide_and_long, "--train.precision", precision])
        other = "fp16" if precision == "bf16" else "bf16"  # a precision the CPU has instructions for
        assert not _wants([*wide_and_long, "--train.precision", other])
        assert not _wants([*wide_and_long, "--train.precision", precision], device="meta")
        assert not _wants([*wide_and_long, "--train.precision", precision, "--train.attention_fp32", "false"])
        assert not _wants([*wide_and_long, "--train.precision", precision], cp=object())


def test_a_toml_boolean_still_sets_it(tmp_path):
    for value, setting in (("true", "true"), ("false", "false"), ('"auto"', "auto")):
        path = tmp_path / f"{value.strip(chr(34))}.toml"
        path.write_text(f"[train]\nprecision = \"bf16\"\nattention_fp32 = {value}\n")
        assert load_config(path, []).train.attention_fp32 == setting


def test_without_a_gradient_to_come_the_16_bit_core_runs():
    q = k = v = torch.ones(1, 2, 3, 4, dtype=torch.bfloat16)
    dtypes = []
    core = in_fp32(lambda q, k, v, mask: dtypes.append(q.dtype) or q)
    core(q, k, v, None)  # evaluation, generation: the fp32 forward alone is slower
    core(q.clone().requires_grad_(), k, v, None)
    assert dtypes == [torch.bfloat16, torch.float32]


def _losses(corpus, run_dir, **extra):
    # The host flash kernel off: where it runs, it takes the cores these tests compare.
    overrides = {"train.precision": "bf16", "train.host_attention": "false", **extra}
    trainer = Trainer(load_config(None, tiny_overrides(corpus, run_dir, **overrides)))
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    timer = trainer.compile_timer
    trainer.close()
    return losses, timer


def test_bf16_training_with_fp32_attention_follows_the_bf16_run(small_corpus, tmp_path):
    plain, _ = _losses(small_corpus, tmp_path / "plain", **{"train.attention_fp32": "false"})
    upcast, _ = _losses(small_corpus, tmp_path / "upcast", **{"train.attention_fp32": "true"})
    assert upcast != plain  # the attention really ran otherwise
    torch.testing.assert_close(upcast, plain, rtol=2e-2, atol=0)  # within bf16's rounding of a few steps
    compiled, timer = _losses(small_corpus, tmp_path / "compiled", **{"train.attention_fp32": "true",
                                                                       "train.compile": True})
    assert timer.breaks == 0 and timer.graphs == 1 + 2  # the blocks still share one graph
    torch.testing.assert_close(compiled, upcast, rtol=1e-2, atol=0)
