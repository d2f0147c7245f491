"""The host kernel for decoding's few-row products: exact dot products within fp32 rounding, bf16
rounded once, the same bits on any thread count, usable in compiled graphs, and a build that
fails without taking generation with it."""

from __future__ import annotations

import ctypes
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from polytrain.backend import host_matmul

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler on this machine: the kernel cannot be built")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert host_matmul.available(), "the host matmul kernel did not build (see the warning above)"


def operands(rows: int, out_features: int, in_features: int, with_bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    return x, weight, bias


# 770 inputs leave a tail after the vector lanes; 513 outputs leave a row after tiles of 16, 131
# three (a tile of odd size: its rows walked one at a time), 40 eight (walked two side by side);
# 2,500 inputs run in blocks of 1,024 with 8 or more rows, partial sums carried between them
@pytest.mark.parametrize("out_features,in_features", [(513, 770), (96, 64), (1, 16), (40, 3), (131, 2500)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_products_are_the_exact_dot_products_within_rounding(out_features, in_features, rows, with_bias):
    x, weight, bias = operands(rows, out_features, in_features, with_bias)
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    got = host_matmul.thin_linear(x, weight, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # each output sums in_features products: fp32 rounding grows with sqrt(in_features)
    tolerance = 4e-7 * in_features ** 0.5 * (x.abs().max() * weight.abs().max()).item() * 4
    torch.testing.assert_close(got.double(), exact, atol=tolerance, rtol=0)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=2 * tolerance, rtol=0)


# 96 inputs fill whole vector steps (16 lanes widened, 32 in bf16 pairs and AMX tile rows); 770
# leave a tail; 2,500 run in blocks of 2,048 with 8 or more rows; 257, 65 and 33 outputs leave one row
# after blocks of 16 (AMX's tiles); on AMX 20 rows are two tiles of x against each weight tile, 50
# two passes over the weight (48 rows, then 2)
@pytest.mark.parametrize("out_features,in_features", [(257, 96), (65, 770), (33, 2500)])
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 20, 50])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_products_are_summed_in_fp32_and_rounded_once(out_features, in_features, rows, with_bias):
    x, weight, bias = (t if t is None else t.bfloat16()
                       for t in operands(rows, out_features, in_features, with_bias, seed=1))
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    got = host_matmul.thin_linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    # one rounding to bf16 (half its spacing at the exact value) plus fp32's summing, nothing more
    spacing = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    summing = in_features * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().t()
                                           + (0 if bias is None else bias.double().abs()))
    assert ((got.double() - exact).abs() <= spacing / 2 + summing).all()
    # and the nearest bf16 of the exact sum almost everywhere (a tie within fp32 rounding may not be)
    assert (got != exact.bfloat16()).sum() <= 1 + 0.01 * got.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_output_gets_the_same_bits_whatever_the_threads_and_the_other_rows(dtype):
    # 50 rows: seven blocks of 8 rows (FMA kernel), two passes of 48 and 2 (AMX); 2,100 inputs: 2-3 blocks
    x, weight, bias = (t.to(dtype) for t in operands(50, 1031, 2100, True))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = host_matmul.thin_linear(x, weight, bias)
        torch.set_num_threads(2)
        two = host_matmul.thin_linear(x, weight, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    # a row alone, or with a few others, sums exactly as in the full batch: a sequence's tokens
    # do not depend on how many others decode beside it
    for rows in (slice(3, 4), slice(0, 5), slice(8, 11), slice(14, 20), slice(30, 50)):
        assert torch.equal(host_matmul.thin_linear(x[rows].contiguous(), weight, bias), two[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_stays_in_its_own_row(dtype):
    x, weight, bias = (t.to(dtype) for t in operands(4, 40, 70, True))
    x[1, 5] = float("nan")
    got = host_matmul.thin_linear(x, weight, bias)
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_whole_tiles_round_as_the_last_tile_and_as_torch(dtype, rows):
    # 16 weight rows of 96 inputs (no tail) are finished 16 lanes at a time, a last tile of 15 one
    # output at a time: the same bits, and torch's rounding of the exact sums, ties to even
    x = torch.zeros(rows, 96, dtype=dtype)
    x[:, :2] = 1.0
    weight = torch.zeros(16, 96, dtype=dtype)
    weight[:, 0] = 256.0
    weight[:, 1] = torch.arange(16, dtype=dtype) * 2 + 1  # sums 257, 259, ...: halfway between bf16s
    weight[3, 7] = float("inf")
    weight[4, 0] = float("nan")
    bias = torch.arange(16, dtype=dtype) * 2  # sums 257, 261, ..., 317 with it: still ties
    whole = host_matmul.thin_linear(x, weight, bias)
    last = host_matmul.thin_linear(x, weight[:15].contiguous(), bias[:15].contiguous())
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(whole[:, :15].contiguous().view(bits), last.view(bits))  # NaN's bits too
    exact = (x.double() @ weight.double().t() + bias.double()).to(dtype)  # inf * 0 is NaN: both sides
    assert torch.equal(whole.isnan(), exact.isnan())
    assert torch.equal(whole.nan_to_num(), exact.nan_to_num())


def _amx_usable() -> bool:
    """The CPU lists AMX-BF16 and Linux grants this process the tile state (asked here directly,
    not through the kernel under test: x86-64's arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    if not {"amx_tile", "amx_bf16"} <= set(flags) or platform.machine() != "x86_64":
        return False
    return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0


@pytest.mark.skipif(not _amx_usable(), reason="no AMX on this CPU, or the OS withholds it: the FMA kernel runs")
def test_bf16_products_run_on_amx_where_the_cpu_has_it_and_leave_torch_gemms_right():
    assert host_matmul.uses_amx()
    # oneDNN runs torch's bf16 GEMMs on the same tile registers: each side configures its own
    x, weight, bias = (t.bfloat16() for t in operands(64, 512, 512, True))
    for _ in range(2):
        thin = host_matmul.thin_linear(x[:8].contiguous(), weight, bias)
        gemm = F.linear(x, weight, bias)
        exact = x.double() @ weight.double().t() + bias.double()
        for got, want in ((thin, exact[:8]), (gemm, exact)):
            torch.testing.assert_close(got.double(), want, atol=0.01 * want.abs().max().item(), rtol=0)


def test_bad_operands_are_refused_by_name():
    x, weight, _ = operands(2, 8, 4, False)
    with pytest.raises(RuntimeError, match=r"x \(M, K\) and weight \(N, K\)"):
        host_matmul.thin_linear(x, weight.t().contiguous())
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        host_matmul.thin_linear(x.double(), weight.double())
    with pytest.raises(RuntimeError, match="contiguous x and weight"):
        host_matmul.thin_linear(x, torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="bias of 8 elements"):
        host_matmul.thin_linear(x, weight, torch.zeros(7))


def test_a_compiled_graph_calls_it_without_breaking():
    x, weight, bias = operands(4, 64, 32, True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(host_matmul.thin_linear(x * 2, weight, bias))

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    assert torch.equal(compiled(x), layer(x))


def test_a_failed_build_warns_and_leaves_f_linear(monkeypatch, tmp_path):
    broken = tmp_path / "host_matmul.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(host_matmul, "SOURCES", (broken,))
    monkeypatch.setattr(host_matmul, "available", host_matmul.available.__wrapped__)
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="could not be built"):
        assert host_matmul.available() is False


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(host_matmul.ENV_VAR, "0")
    assert host_matmul.available.__wrapped__() is False
