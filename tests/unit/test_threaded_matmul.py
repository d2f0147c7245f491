"""Decoding's few-row matmuls: split over threads (the same products, only where measured faster)
or streamed through the host kernel, every layer restored after."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.backend import host_matmul
from polytrain.config import ModelConfig
from polytrain.inference import continuous, threaded_matmul
from polytrain.inference.generate import generate
from polytrain.inference.threaded_matmul import split_is_faster, split_linear, threaded_linears
from polytrain.lora.adapter import LoRALinear
from polytrain.models.common.init import init_plain
from polytrain.models.llama.model import Llama
from tests.gemm_dtypes import GemmDtypes

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=48)
PROMPTS = [[5, 17, 3, 88, 42, 9, 61], [23, 4], [70, 70, 12, 1]]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def always_split(monkeypatch):
    """Every eligible shape counts as faster split, whatever this machine's timings say, and no
    row count streams through the host kernel."""
    monkeypatch.setattr(threaded_matmul, "split_is_faster", lambda weights, rows, blocks, others: True)
    monkeypatch.setattr(threaded_matmul, "_streams", lambda dtype, rows: False)


@pytest.fixture
def kernel():
    if not host_matmul.available():
        pytest.skip("the host matmul kernel cannot be built here (tests/unit/test_host_matmul.py says why)")


def llama() -> Llama:
    model = Llama(CFG)
    init_plain(model, 0)
    return model


def split_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (64, 128), (256, 48)])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("blocks", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_linear_computes_exactly_what_linear_computes(out_features, in_features, rows, blocks, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    reference = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    got = split_linear(x, weight, blocks, bias)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-6, atol=1e-6)
    # bf16 within its rounding; where this BLAS gives the unbiased split F.linear's bits, the biased
    # split must give them too (a bias added after the product was a last bit off)
    x, weight = x.bfloat16(), weight.bfloat16()
    bias = None if bias is None else bias.bfloat16()
    torch.testing.assert_close(split_linear(x, weight, blocks, bias), F.linear(x, weight, bias))
    if torch.equal(split_linear(x, weight, blocks), F.linear(x, weight)):
        assert torch.equal(split_linear(x, weight, blocks, bias), F.linear(x, weight, bias))


def test_generation_splits_the_layers_and_keeps_the_tokens(two_threads, always_split):
    model = llama()
    unsplit = generate(model, PROMPTS, 10, temperature=0, threaded_matmul=False)
    with threaded_linears(model, len(PROMPTS)) as count:
        # every block Linear and the output head (96 rows: even); nothing else is an nn.Linear
        assert count == CFG.n_layers * 7 + 1 == len(split_layers(model))
        inside = generate(model, PROMPTS, 10, temperature=0, threaded_matmul=False)
    assert split_layers(model) == []
    assert inside == unsplit
    assert generate(model, PROMPTS, 10, temperature=0) == unsplit
    assert generate(model, PROMPTS, 10, temperature=0, static_cache=True, batch_size=2) == unsplit


def test_split_layers_give_the_logits_of_the_plain_model(two_threads, always_split):
    model = llama().eval()
    tokens = torch.tensor([[5], [17], [3]])  # three rows: decoding's shape, split
    prompt = torch.tensor([PROMPTS[0]])  # seven rows: above `rows`, so F.linear
    with torch.no_grad():
        plain = model(tokens), model(prompt)
        with threaded_linears(model, rows=3):
            split = model(tokens), model(prompt)
    for a, b in zip(plain, split):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_lora_layers_odd_shapes_and_one_thread_are_left_alone(two_threads, always_split):
    model = llama()
    model.layers["0"].attention.wq = LoRALinear(model.layers["0"].attention.wq, rank=4, alpha=8)
    model.output = nn.Linear(CFG.dim, 97, bias=False)  # 97 rows do not split into 2 blocks
    with threaded_linears(model, 1):
        names = split_layers(model)
    assert "layers.0.attention.wq" not in names and "output" not in names
    assert "layers.1.attention.wq" in names
    torch.set_num_threads(1)
    with threaded_linears(model, 1) as count:
        assert count == 0


def test_layers_are_restored_when_generation_fails(two_threads, always_split):
    model = llama()
    with pytest.raises(RuntimeError, match="stop"):
        with threaded_linears(model, 1):
            raise RuntimeError("stop")
    assert split_layers(model) == []


def test_an_instance_forward_is_neither_replaced_nor_deleted(two_threads, always_split):
    model = llama()
    users_own = model.layers["0"].attention.wq.forward = lambda x: torch.zeros(x.shape[0], 64)
    with threaded_linears(model, 1) as outer:
        outer_forwards = {name: m.forward for name, m in model.named_modules() if "forward" in m.__dict__}
        with threaded_linears(model, 1) as inner:  # generate inside generate: the outer's split stays
            assert inner == 0
        assert {name: m.forward for name, m in model.named_modules() if "forward" in m.__dict__} == outer_forwards
    assert outer == CFG.n_layers * 7  # every block Linear but the user's, and the output head
    assert split_layers(model) == ["layers.0.attention.wq"]
    assert model.layers["0"].attention.wq.forward is users_own


def test_the_split_is_kept_only_where_clearly_faster(monkeypatch):
    monkeypatch.setattr(threaded_matmul, "_split_faster", {})
    weights = [torch.randn(8, 4)]
    calls = []

    def timings(*seconds):
        def time_s(ways, before):
            calls.append(ways)
            return seconds
        return time_s

    # F.linear first, then the split: 5% faster is noise, 20% faster is kept
    assert not split_is_faster(weights, 1, 2, time_s=timings(1.0, 0.95))
    assert split_is_faster(weights, 3, 2, time_s=timings(1.0, 0.8))
    assert split_is_faster(weights, 3, 2, time_s=timings(1.0, 5.0))  # measured once per shape
    assert len(calls) == 2


def test_every_timed_pass_comes_after_the_other_weights_are_read(monkeypatch):
    events = []
    medians = threaded_matmul._paired_medians([lambda: events.append("linear"), lambda: events.append("split")],
                                              lambda: events.append("flush"), repeats=2)
    assert events == ["flush", "linear", "flush", "split"] * 3 and len(medians) == 2
    others = [torch.ones(256), torch.ones(256), torch.ones(256)]  # 1 KiB each
    read = threaded_matmul._reader(others, limit=2048)
    assert [float(s) for s in read()] == [256.0, 256.0]


def test_measuring_leaves_the_global_random_stream_alone(monkeypatch):
    monkeypatch.setattr(threaded_matmul, "_split_faster", {})
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    split_is_faster([torch.ones(8, 4)], 2, 2)
    assert torch.equal(torch.rand(3), expected)


def streamed_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m.__dict__.get("forward"), "way", None) == "stream"]


def test_two_to_eight_fp32_rows_stream_through_the_kernel_and_keep_the_tokens(kernel, two_threads):
    model = llama()
    model.output = nn.Linear(CFG.dim, 97, bias=False)  # an odd row count streams too (it does not split)
    nn.init.normal_(model.output.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    plain = generate(model, PROMPTS, 10, temperature=0, threaded_matmul=False)
    linears = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    with threaded_linears(model, len(PROMPTS)) as count:
        assert count == len(linears) and streamed_layers(model) == linears
    assert generate(model, PROMPTS, 10, temperature=0) == plain
    assert generate(model, PROMPTS, 10, temperature=0, static_cache=True) == plain


def test_streamed_layers_give_the_logits_of_the_plain_model_within_rounding(kernel):
    model = llama().eval()
    tokens = torch.tensor([[5], [17], [3]])  # three rows: streamed
    prompt = torch.tensor([PROMPTS[0]])  # seven rows: above `rows`, so F.linear, bit for bit
    with torch.no_grad():
        plain = model(tokens), model(prompt)
        with threaded_linears(model, rows=3):
            assert streamed_layers(model)
            streamed = model(tokens), model(prompt)
    torch.testing.assert_close(streamed[0], plain[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(streamed[1], plain[1])


@pytest.mark.parametrize("amx", [False, True])
def test_which_row_counts_and_dtypes_stream(kernel, monkeypatch, amx):
    monkeypatch.setattr(threaded_matmul, "split_is_faster", lambda weights, rows, blocks, others: False)
    monkeypatch.setattr(threaded_matmul.host_matmul, "uses_amx", lambda: amx)  # either way computes right
    model = llama()
    bf16_rows = threaded_matmul.AMX_STREAM_ROWS if amx else threaded_matmul.STREAM_ROWS
    for rows, dtype, streams in [(1, torch.float32, True), (2, torch.float32, True), (16, torch.float32, True),
                                 (17, torch.float32, False), (1, torch.bfloat16, True), (8, torch.bfloat16, True),
                                 (bf16_rows, torch.bfloat16, True), (bf16_rows + 1, torch.bfloat16, False),
                                 (4, torch.float16, False)]:
        model.to(dtype)
        with threaded_linears(model, rows) as count:
            assert (count > 0) == streams, (rows, dtype)


def test_a_compiled_decoding_step_calls_the_kernel_and_keeps_the_tokens(kernel, monkeypatch):
    monkeypatch.setattr(continuous, "BACKEND", "aot_eager")  # the graph without code generation: seconds
    torch._dynamo.reset()
    model = llama()
    plain = generate(model, PROMPTS, 8, temperature=0, threaded_matmul=False)
    assert generate(model, PROMPTS, 8, temperature=0, compile=True) == plain


@pytest.mark.parametrize("emulated,amx", [(True, False), (False, False), (False, True)])
def test_a_bf16_prefill_streams_or_runs_fp32_gemms_where_the_host_emulates_bf16(kernel, monkeypatch, emulated, amx):
    """Emulated: a short prefill streams, a long one runs fp32 GEMMs. Native bf16 GEMMs: F.linear,
    except a short one streamed where the kernel runs bf16 on AMX."""
    monkeypatch.setattr(threaded_matmul.host_gemm, "emulates", lambda dtype: emulated and dtype == torch.bfloat16)
    monkeypatch.setattr(threaded_matmul.host_matmul, "uses_amx", lambda: amx)
    model = llama().bfloat16().eval()
    short = torch.tensor([PROMPTS[0]])  # 7 rows: at most EMULATED_STREAM_ROWS and AMX_STREAM_ROWS, streamed
    long = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))  # 80 rows
    assert short.numel() <= min(threaded_matmul.EMULATED_STREAM_ROWS, threaded_matmul.AMX_STREAM_ROWS)
    assert max(threaded_matmul.EMULATED_STREAM_ROWS, threaded_matmul.AMX_STREAM_ROWS) < long.numel()
    with torch.no_grad():
        plain = model(short), model(long)
        with threaded_linears(model, rows=1):
            with GemmDtypes() as short_gemms:
                prefilled = [model(short)]
            with GemmDtypes() as long_gemms:
                prefilled.append(model(long))
    if not emulated:  # the long one through the layer's own F.linear, bit for bit
        assert torch.equal(prefilled[1], plain[1])
        if not amx:
            assert torch.equal(prefilled[0], plain[0])
            return
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert short_gemms.seen == {}  # every product in the host kernel
    if emulated:
        assert long_gemms.seen == {torch.float32: linears}  # every product an fp32 GEMM
    for got, want in zip(prefilled, plain):  # bf16 results rounded from sums in another order
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())
