"""The host kernel for decoding's attention: softmax(scale q k^T + mask) v within fp32 rounding of
the exact value, bf16 rounded once, masked slots and strided caches as SDPA takes them, NaN
where every slot is masked, refused where it does not apply, and used by generation."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from polytrain.backend import host_attention, host_matmul
from polytrain.config import ModelConfig
from polytrain.inference.generate import generate
from polytrain.models.common.attention import Attention
from polytrain.models.common.init import init_plain
from polytrain.models.llama.model import Llama

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler on this machine: the kernel cannot be built")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert host_matmul.available(), "the host kernels did not build (see the warning above)"


def exact(q, k, v, mask, scale):
    """The definition in float64: q (B, H, G, D), k and v (B, H, S, D)."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale  # (B, H, G, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return scores.softmax(-1) @ v.double()


def operands(B, H, G, S, D, dtype, seed=0):
    """q, and k, v as slices of a longer cache (B, H, S + 5, 2D): strides as a cache's."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, G, D, generator=gen).to(dtype)
    cache = torch.randn(B, H, S + 5, 2 * D, generator=gen).to(dtype)
    return q, cache[:, :, :S, :D], cache[:, :, :S, D:]


def masks(B, S, seed=0):
    keep = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(seed)) < 0.6
    keep[..., 0] = True  # no row masked whole here
    return {"none": None, "bool per row": keep, "bool shared": keep[:1], "additive": torch.where(keep, 0.0, -1e9),
            "additive -inf": torch.where(keep, 0.0, float("-inf"))}


# G 9 runs as passes of 8 and 1 query heads; D 70 leaves a tail after the vector lanes; S 1 and 33
@pytest.mark.parametrize("B,H,G,S,D", [(2, 2, 3, 33, 64), (1, 3, 9, 40, 70), (3, 1, 1, 1, 16), (2, 2, 4, 200, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "bool per row", "bool shared", "additive", "additive -inf"])
def test_the_attention_of_one_query_per_head_within_rounding(B, H, G, S, D, dtype, mask_kind):
    q, k, v = operands(B, H, G, S, D, dtype)
    mask = masks(B, S)[mask_kind]
    want = exact(q, k, v, mask, D ** -0.5)
    got = host_attention.decode_attention(q, k, v, mask, None)  # None: 1 / sqrt(D)
    assert got.shape == (B, H, G, D) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-6 * want.abs().max().item(), rtol=2e-6)
    else:  # fp32 sums, then one rounding: half a bf16 spacing of the value and a little more
        spacing = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert ((got.double() - want).abs() <= spacing / 2 + 1e-5 * want.abs().max()).all()


def test_a_row_masked_whole_is_nan_as_in_torch():
    q, k, v = operands(2, 1, 2, 6, 16, torch.float32)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1] = False
    got = host_attention.decode_attention(q, k, v, mask, 0.5)
    torch.testing.assert_close(got[0], F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)[0])
    assert got[1].isnan().all()


def test_what_it_does_not_take_it_leaves_to_the_caller():
    q, k, v = operands(1, 2, 2, 8, 16, torch.float32)
    assert host_attention.decode_attention(q.half(), k.half(), v.half(), None, None) is None
    assert host_attention.decode_attention(q.requires_grad_(), k, v, None, None) is None  # a gradient wanted
    with torch.no_grad():
        assert host_attention.decode_attention(q, k, v, None, None) is not None
    queries_mask = torch.ones(1, 1, 2, 8, dtype=torch.bool)  # a mask per query: not decoding's
    assert host_attention.decode_attention(q.detach(), k, v, queries_mask, None) is None


def test_bad_operands_are_refused_by_name():
    q, k, v = operands(1, 2, 2, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="k and v of shape"):
        torch.ops.polytrain.decode_attention(q, k[:, :1], v[:, :1], None, 1.0)
    with pytest.raises(RuntimeError, match="mask of shape"):
        torch.ops.polytrain.decode_attention(q, k, v, torch.ones(1, 1, 1, 7, dtype=torch.bool), 1.0)


def test_a_compiled_graph_calls_it_without_breaking():
    q, k, v = operands(2, 2, 3, 10, 16, torch.float32)
    mask = masks(2, 10)["bool per row"]

    def core(q, k, v):
        return host_attention.decode_attention(q * 2, k, v, mask, 0.25) + 1

    torch._dynamo.reset()
    compiled = torch.compile(core, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    assert torch.equal(compiled(q, k, v), core(q, k, v))


def test_generation_attends_through_it_and_gives_the_layers_back(monkeypatch):
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=48)
    model = Llama(cfg)
    init_plain(model, 0)
    calls, real = [], host_attention.decode_attention

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    plain = generate(model, [[5, 17, 3, 88], [23, 4]], 6, temperature=0, threaded_matmul=False)
    assert calls == []
    monkeypatch.setattr(host_attention, "decode_attention", counted)
    assert generate(model, [[5, 17, 3, 88], [23, 4]], 6, temperature=0) == plain
    assert calls and all(calls)  # every decoding step's layers, none refused
    assert all(m.decode_kernel is None for m in model.modules() if isinstance(m, Attention))
