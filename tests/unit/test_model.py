"""Llama decoder: shapes, names, initialization, causality, KV cache, precision."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from polytrain.config import ModelConfig
from polytrain.models.common.init import init_plain, seed_for
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.norms import RMSNorm
from polytrain.models.common.rope import apply_rope, rope_tables
from polytrain.models.llama.model import Llama
from polytrain.models.registry import ARCHITECTURES, LLAMA_PRESETS

SMALL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97,
                    max_seq_len=64)


def make(seed: int = 0, **overrides) -> Llama:
    model = Llama(dataclasses.replace(SMALL, **overrides))
    init_plain(model, seed)
    return model


def tokens(batch: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def preset(size: str) -> ModelConfig:
    return ModelConfig(size=size, max_seq_len=256, **LLAMA_PRESETS[size])


def test_forward_shape_dtype_and_gradients():
    model = make()
    logits = model(tokens(2, 10))
    assert logits.shape == (2, 10, SMALL.vocab_size) and logits.dtype == torch.float32
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_registry_builds_llama():
    assert isinstance(ARCHITECTURES["llama"].build(SMALL), Llama)


def test_tiny_parameter_count():
    c = preset("tiny")
    kv = c.n_kv_heads * c.dim // c.n_heads
    per_layer = 2 * c.dim * c.dim + 2 * kv * c.dim + 3 * c.dim * c.ffn_dim + 2 * c.dim
    expected = 2 * c.vocab_size * c.dim + c.n_layers * per_layer + c.dim
    model = Llama(c)
    assert model.num_params() == expected == 3_147_456
    assert model.num_params(exclude_embeddings=True) == expected - c.vocab_size * c.dim


@pytest.mark.parametrize("size, low, high", [("1b", 1.0e9, 1.2e9), ("7b", 6.6e9, 6.8e9)])
def test_large_presets_counted_on_meta(size, low, high):
    with torch.device("meta"):
        model = Llama(preset(size))
    assert low < model.num_params() < high


def test_flops_per_token_formula():
    model = make()
    n = model.num_params(exclude_embeddings=True)
    assert model.flops_per_token(32) == 6 * n + 12 * SMALL.n_layers * SMALL.dim * 32


def test_stable_parameter_names_and_no_rope_in_checkpoint():
    block = ["attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
             "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
             "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"]
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(SMALL.n_layers) for name in block}
    model = Llama(SMALL)
    assert set(model.state_dict()) == expected
    assert list(model.layers) == ["0", "1"]
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert {name for name, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}


def test_tied_embeddings_share_one_parameter_even_after_meta_build():
    cfg = dataclasses.replace(SMALL, tie_embeddings=True)
    model = Llama(cfg)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == Llama(SMALL).num_params() - SMALL.vocab_size * SMALL.dim
    # Tied, the table is the output projection and stays in the non-embedding count.
    assert model.num_params(exclude_embeddings=True) == model.num_params()
    with torch.device("meta"):
        meta = Llama(cfg)
    meta.to_empty(device="cpu")
    assert meta.output.weight is meta.tok_embeddings.weight
    init_plain(meta, 0)
    assert [name for name, _ in meta.named_parameters()].count("output.weight") == 0


def test_meta_build_initializes_like_cpu_build():
    cpu = make(seed=7)
    with torch.device("meta"):
        meta = Llama(SMALL)
    meta.to_empty(device="cpu")
    init_plain(meta, 7)
    for (name, a), b in zip(cpu.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(cpu.rope_cos, meta.rope_cos) and torch.equal(cpu.rope_sin, meta.rope_sin)
    x = tokens(1, 8)
    assert torch.equal(cpu(x), meta(x))
    other = make(seed=8)
    assert not torch.equal(cpu.layers["0"].attention.wq.weight, other.layers["0"].attention.wq.weight)


def test_init_is_independent_of_order_and_of_other_layers():
    model = make(seed=3)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(999)  # the global generator must not matter
    with torch.no_grad():
        for name, param in reversed(list(model.named_parameters())):
            full = torch.empty(param.shape)
            model.init_parameter(name, full, torch.Generator().manual_seed(seed_for(3, name)))
            param.copy_(full)
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
    deeper = make(seed=3, n_layers=4)  # a layer's draw does not depend on the layer count
    assert torch.equal(deeper.layers["1"].attention.wq.weight, model.layers["1"].attention.wq.weight)


def test_init_distribution():
    model = make(n_layers=8, dim=128, n_heads=4, ffn_dim=512)
    assert torch.equal(model.layers["3"].ffn_norm.weight, torch.ones(128))
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(16)
    assert model.layers["0"].feed_forward.w2.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert model.layers["0"].attention.wo.weight.std().item() == pytest.approx(scaled, rel=0.05)


@pytest.mark.parametrize("name, shape", [
    ("layers.2.attention.wq.weight", (64, 64)),  # only layers 0 and 1 exist
    ("layers.0.norm.weight", (64,)),
    ("attention.wq.weight", (64, 64)),
    ("rope_cos", (64, 8)),
    ("layers.0.attention.wk.weight", (64, 64)),  # wrong shape: GQA makes it (32, 64)
])
def test_init_parameter_rejects_unknown_names_and_wrong_shapes(name, shape):
    with pytest.raises(ValueError):
        Llama(SMALL).init_parameter(name, torch.empty(shape), torch.Generator())


def test_causal():
    model = make()
    x = tokens(1, 12)
    y = x.clone()
    y[0, 7] = (y[0, 7] + 1) % SMALL.vocab_size
    a, b = model(x), model(y)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_kv_cached_forward_matches_full_forward(n_kv_heads):
    model = make(n_kv_heads=n_kv_heads).eval()
    x = tokens(2, 16)
    full = model(x)
    cache = KVCache(batch_size=2, max_len=16)
    parts = [model(x[:, :5], cache=cache, start_pos=0)]  # prefill
    parts += [model(x[:, t:t + 1], cache=cache, start_pos=t) for t in range(5, 12)]  # one by one
    parts.append(model(x[:, 12:], cache=cache, start_pos=12))  # a chunk after the start
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "bool rows", "float shared"])
def test_decoding_attention_reads_shared_kv_heads_without_repeating_them(monkeypatch, mask_kind):
    attention = make(n_heads=4, n_kv_heads=2).layers["0"].attention
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 4, 16, generator=gen).transpose(1, 2)  # (B, H, 1, D) as forward makes it
    k, v = torch.randn(2, 3, 2, 11, 16, generator=gen)  # (B, Hkv, S, D)
    mask = {"none": None,
            "bool rows": (torch.arange(11)[None, :] <= torch.tensor([[4], [10], [7]]))[:, None, None, :],
            "float shared": torch.randn(1, 1, 1, 11, generator=gen)}[mask_kind]
    # the reference: every query head against its own copy of its kv head, in float64
    kr, vr = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    scores = q.double() @ kr.transpose(-1, -2) / 4.0
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    reference = scores.softmax(-1) @ vr
    monkeypatch.setattr("polytrain.models.common.attention.repeat_kv", None)  # decoding must not call it
    torch.testing.assert_close(attention.core(q, k, v, mask).double(), reference, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mask_kind", ["none", "bool rows", "float shared"])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_attention_as_sums_is_sdpa(mask_kind, scale):
    from polytrain.models.common.attention import attention_as_sums

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 4, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g),
               torch.randn(3, 2, 9, 16, generator=g))
    lengths = torch.tensor([2, 8, 5])[:, None, None, None]  # (B, 1, 1, 1) slots each row has written
    mask = {"none": None, "bool rows": torch.arange(9) <= lengths,
            "float shared": torch.randn(1, 1, 1, 9, generator=g)}[mask_kind]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(attention_as_sums(q, k, v, mask, scale), want, atol=1e-6, rtol=1e-5)
    # bf16 inputs: summed in fp32, the output rounded once (fp32 attention of the same values, rounded)
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    want16 = torch.nn.functional.scaled_dot_product_attention(q16.float(), k16.float(), v16.float(),
                                                              attn_mask=mask, scale=scale).bfloat16()
    got16 = attention_as_sums(q16, k16, v16, mask, scale)
    assert got16.dtype == torch.bfloat16
    # equal but where fp32 rounding moves a value across a bf16 rounding boundary (one ulp); sums in
    # bf16 would differ in about half of them
    assert (got16 != want16).float().mean() <= 0.02
    torch.testing.assert_close(got16, want16, atol=1e-2, rtol=0)


def test_a_mask_per_head_or_query_still_repeats_the_kv_heads():
    attention = make(n_heads=4, n_kv_heads=2).layers["0"].attention
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    assert attention._one_query_per_group(q, k, None)
    assert not attention._one_query_per_group(q, k, torch.zeros(1, 4, 1, 5))  # a bias per head (T5)
    assert not attention._one_query_per_group(torch.randn(1, 4, 2, 16), k, None)  # two queries: causal
    assert not attention._one_query_per_group(torch.randn(1, 2, 1, 16), k, None)  # a kv head per query head


def test_left_padded_batch_matches_each_row_alone():
    model = make().eval()
    rows = [tokens(1, 9, seed=1)[0], tokens(1, 5, seed=2)[0]]
    pad = torch.tensor([0, 4])
    batch = torch.stack([rows[0], torch.cat([torch.zeros(4, dtype=torch.long), rows[1]])])
    cache = KVCache(batch_size=2, max_len=11, pad=pad)
    prefill = model(batch, cache=cache, start_pos=0)
    step = model(torch.tensor([[3], [4]]), cache=cache, start_pos=9)
    for i, row in enumerate(rows):
        alone = model(torch.cat([row, torch.tensor([3 + i])])[None])
        torch.testing.assert_close(prefill[i, pad[i]:], alone[0, :-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(step[i, 0], alone[0, -1], atol=1e-5, rtol=0)


def test_pipeline_stages_compose_to_the_full_model():
    model = make()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm = first.output = None
    del last.layers["0"]
    last.tok_embeddings = None
    x = tokens(2, 6)
    hidden = first(x)
    assert hidden.shape == (2, 6, SMALL.dim)
    torch.testing.assert_close(last(hidden), model(x), atol=0, rtol=0)


def test_bf16_autocast_close_to_fp32():
    model = make()
    x = tokens(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x)
    assert low.dtype == torch.bfloat16
    full = model(x)
    assert (low.float() - full).abs().max() < 0.05 * full.abs().max()


def test_positions_beyond_max_seq_len_rejected():
    model = make()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, SMALL.max_seq_len + 1))


@pytest.mark.parametrize("seed", [0, 1234])
def test_parameter_seeds_are_distinct(seed):
    with torch.device("meta"):
        names = [name for name, _ in Llama(preset("7b")).named_parameters()]
    assert len({seed_for(seed, name) for name in names}) == len(names)
    assert seed_for(seed, names[0]) != seed_for(seed + 1, names[0])


def test_rope_is_a_rotation_by_relative_position():
    cos, sin = rope_tables(head_dim=16, max_len=32, theta=10000.0)
    q, k = torch.randn(2, 1, 1, 16, generator=torch.Generator().manual_seed(0)).unbind(0)  # (T, H, D)

    def at(x, pos):
        return apply_rope(x[None], cos[pos:pos + 1], sin[pos:pos + 1])[0, 0, 0]  # (D,)

    torch.testing.assert_close(at(q, 0), q[0, 0])  # position 0 is the identity
    torch.testing.assert_close(at(q, 9).norm(), q.norm())  # rotations keep the norm
    score = at(q, 7) @ at(k, 3)
    torch.testing.assert_close(at(q, 20) @ at(k, 16), score)  # only the offset matters
    assert not torch.allclose(at(q, 20) @ at(k, 15), score)


def test_kv_cache_positions_and_mask_for_left_padding():
    cache = KVCache(batch_size=2, max_len=6, pad=torch.tensor([0, 2]))
    assert cache.positions(0, 4, torch.device("cpu")).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    mask = cache.attn_mask(0, 4, torch.device("cpu"))  # (B, 1, T, S)
    assert mask[0, 0].tolist() == torch.ones(4, 4).tril().bool().tolist()
    assert mask[1, 0].tolist() == [[True, False, False, False], [False, True, False, False],
                                   [False, False, True, False], [False, False, True, True]]
    step = cache.attn_mask(4, 1, torch.device("cpu"))  # one new token sees all but padding
    assert step[:, 0, 0].tolist() == [[True] * 5, [False, False, True, True, True]]
    unpadded = KVCache(batch_size=2, max_len=6)
    assert unpadded.positions(3, 1, torch.device("cpu")) is None
    assert unpadded.attn_mask(0, 4, torch.device("cpu")) is None  # plain causal
    assert unpadded.attn_mask(3, 1, torch.device("cpu")) is None  # one token sees everything
    assert unpadded.attn_mask(3, 2, torch.device("cpu")).shape == (1, 1, 2, 5)


def test_rms_norm_scales_to_unit_rms_and_keeps_dtype():
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.fill_(2.0)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 50
    y = norm(x)
    torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.full((3,), 2.0), rtol=1e-4, atol=0)
    low = norm(x.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), y, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode, core_runs, block_runs", [("none", 2, 2), ("selective", 4, 2), ("full", 4, 4)])
def test_activation_checkpointing_recomputes_what_its_mode_names(monkeypatch, mode, core_runs, block_runs):
    from polytrain.distributed.activation_checkpoint import apply_activation_checkpointing
    from polytrain.models.common.attention import Attention
    from polytrain.models.llama.model import Block

    calls = {"core": 0, "block": 0}
    for cls, key in ((Attention, "core"), (Block, "block")):
        original = getattr(cls, "core" if key == "core" else "forward")

        def counted(self, *args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "core" if key == "core" else "forward", counted)
    model = make()
    apply_activation_checkpointing(model, mode)
    model(tokens(2, 8)).sum().backward()
    # Two layers: each counted function runs once per layer in forward, again if recomputed.
    assert (calls["core"], calls["block"]) == (core_runs, block_runs)
