"""The zoo's modules without transformers: names, initialisation, caches, RoPE scaling, config rules."""

from __future__ import annotations

import math

import pytest
import torch

from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.models.common.init import init_plain
from polytrain.models.common.kv_cache import KVCache
from polytrain.models.common.rope import RopeScaling, inv_frequencies, rope_for_length, rope_tables
from polytrain.models.internlm2.model import InternLM2
from polytrain.models.registry import model_config
from polytrain.models.t5.model import relative_position_bucket

SMALL = dict(dim=32, n_layers=2, n_heads=4, ffn_dim=48, vocab_size=53, max_seq_len=40)
CONFIGS = {
    "llama": model_config("llama", **SMALL, n_kv_heads=2),
    "internlm2": model_config("internlm2", **SMALL, n_kv_heads=2),
    "gpt2": model_config("gpt2", **SMALL, n_kv_heads=4),
    "bert": model_config("bert", **SMALL, n_kv_heads=4),
    "t5": model_config("t5", **SMALL, n_kv_heads=4, n_decoder_layers=3, head_dim=6),
}


def make(arch: str, seed: int = 0):
    model = ARCHITECTURES[arch].build(CONFIGS[arch])
    init_plain(model, seed)
    return model


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 53, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, x):
    return model(x, x[:, :7]) if model.cfg.arch == "t5" else model(x)


@pytest.mark.parametrize("arch", CONFIGS)
def test_meta_build_initialises_like_a_cpu_build_and_every_parameter_learns(arch):
    cpu = make(arch, seed=3)
    with torch.device("meta"):
        meta = ARCHITECTURES[arch].build(CONFIGS[arch])
    meta.to_empty(device="cpu")
    init_plain(meta, 3)
    for (name, a), b in zip(cpu.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name
    x = tokens(2, 9)
    assert torch.equal(run(cpu, x), run(meta, x))
    out = run(cpu, x)
    assert out.shape[-1] == 53 and out.dtype == torch.float32
    out.logsumexp(-1).mean().backward()
    for name, p in cpu.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_module_names_follow_each_architectures_checkpoints():
    names = {arch: set(make(arch).state_dict()) for arch in CONFIGS}
    assert "layers.1.attention.wqkv.weight" in names["internlm2"]
    assert not any(".wq." in n or ".wk." in n for n in names["internlm2"])
    assert {"pos_embeddings.weight", "layers.0.attention.wq.bias", "layers.0.feed_forward.w1.bias",
            "layers.0.attention_norm.bias", "norm.bias"} <= names["gpt2"]
    assert not any(".w3." in n for n in names["gpt2"] | names["bert"])
    assert {"type_embeddings.weight", "embed_norm.weight", "head_dense.weight", "head_norm.bias",
            "output.bias"} <= names["bert"]
    assert {"encoder_pos_bias.weight", "decoder_pos_bias.weight", "encoder_norm.weight",
            "decoder_norm.weight", "layers.2.cross_attention.wq.weight"} <= names["t5"]
    assert "layers.1.cross_attention.wq.weight" not in names["t5"]  # blocks 0-1 encode, 2-4 decode
    assert max(int(n.split(".")[1]) for n in names["t5"] if n.startswith("layers.")) == 4
    for arch in ("gpt2", "bert"):  # tied: one parameter under two names
        model = make(arch)
        assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("arch", CONFIGS)
def test_init_parameter_rejects_unknown_names_and_wrong_shapes(arch):
    model = make(arch)
    with pytest.raises(ValueError, match="no parameter named"):
        model.init_parameter("layers.9.attention.wo.weight", torch.empty(32, 32), torch.Generator())
    name, param = next(iter(model.named_parameters()))
    with pytest.raises(ValueError, match="has full shape"):
        model.init_parameter(name, torch.empty(param.shape[0] + 1, *param.shape[1:]), torch.Generator())


def test_internlm2_unpacks_wqkv_in_grouped_order():
    """Rows per key/value group: its query heads, then k, then v (InternLM2's checkpoint layout)."""
    model = make("internlm2")  # 4 query heads, 2 kv heads, head_dim 8: groups of 4 heads x 8 rows
    attention = model.layers["0"].attention
    with torch.no_grad():
        attention.wqkv.weight.zero_()
        attention.wqkv.weight[:, 0] = torch.arange(attention.wqkv.weight.shape[0], dtype=torch.float32)
    x = torch.zeros(1, 1, 32)
    x[..., 0] = 1.0  # picks column 0: every output is its row index
    q, k, v = (t[0, 0, :, 0].tolist() for t in attention.project(x))  # first element of each head
    rows = lambda group, slot: (group * 4 + slot) * 8  # noqa: E731
    assert q == [rows(0, 0), rows(0, 1), rows(1, 0), rows(1, 1)]
    assert k == [rows(0, 2), rows(1, 2)] and v == [rows(0, 3), rows(1, 3)]


@pytest.mark.parametrize("arch", ["gpt2", "internlm2"])
def test_kv_cached_decoding_equals_the_full_forward(arch):
    model = make(arch).eval()
    x = tokens(2, 12)
    with torch.no_grad():
        full = model(x)
        cache = KVCache(2, 12)
        steps = [model(x[:, :5], cache=cache, start_pos=0)]
        steps += [model(x[:, i:i + 1], cache=cache, start_pos=i) for i in range(5, 12)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "internlm2"])
def test_logits_at_one_position_are_that_position_of_the_full_logits(arch):
    model = make(arch).eval()
    x = tokens(2, 12)
    with torch.no_grad():
        full = model(x)  # (2, 12, vocab)
        for at in (-1, 0, 7):
            got = model(x, logits_at=at)
            assert got.shape == (2, 1, 53)
            torch.testing.assert_close(got, full[:, [at]], atol=1e-6, rtol=0)
        # a prefill into a cache keeps every prompt token's keys and values, not just the last one's
        cache = KVCache(2, 12)
        model(x[:, :9], cache=cache, start_pos=0, logits_at=-1)
        decoded = [model(x[:, i:i + 1], cache=cache, start_pos=i) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat(decoded, 1), full[:, 9:], atol=1e-5, rtol=0)


def test_t5_cached_decoding_equals_the_full_decoder():
    model = make("t5").eval()
    src, tgt = tokens(2, 10), tokens(2, 8, seed=1)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        full = model(src, tgt, attention_mask=mask)
        memory = model.encode(src, mask)
        cache = KVCache(2, 8)
        steps = [model.decode(tgt[:, i:i + 1], memory, mask, cache=cache, start_pos=i) for i in range(8)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_bert_padding_does_not_change_the_real_tokens():
    model = make("bert").eval()
    x = tokens(1, 9)
    padded = torch.cat([x, tokens(1, 4, seed=9)], 1)
    mask = torch.tensor([[1] * 9 + [0] * 4])
    with torch.no_grad():
        assert torch.allclose(model(padded, attention_mask=mask)[:, :9], model(x), atol=1e-5)


def test_t5_relative_buckets_follow_the_published_rule():
    rel = torch.tensor([0, -1, 1, -7, -8, 7, 8, -127, -128, -1000, 1000])
    # bidirectional, 32 buckets (16 per direction: 8 exact, 8 logarithmic up to 128)
    got = relative_position_bucket(rel, True, 32, 128).tolist()
    far = lambda d: 8 + int(math.log(d / 8) / math.log(128 / 8) * 8)  # noqa: E731
    assert got == [0, 1, 17, 7, far(8), 16 + 7, 16 + far(8), far(127), 15, 15, 31]
    # causal: later keys all fall in bucket 0; 32 buckets backwards (16 exact)
    assert relative_position_bucket(torch.tensor([5, 0, -3, -40]), False, 32, 128).tolist() == \
        [0, 0, 3, 16 + int(math.log(40 / 16) / math.log(128 / 16) * 16)]


def test_rope_scaling_variants():
    base = inv_frequencies(16, 10000.0)
    linear = inv_frequencies(16, 10000.0, RopeScaling("linear", 4.0))
    assert torch.allclose(linear, base / 4)
    llama3 = inv_frequencies(16, 10000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, original_max_len=64))
    wavelength = 2 * math.pi / base
    assert torch.equal(llama3[wavelength < 16], base[wavelength < 16])  # short: kept
    assert torch.allclose(llama3[wavelength > 64], base[wavelength > 64] / 8)  # long: slowed by 8
    middle = (wavelength >= 16) & (wavelength <= 64)
    assert middle.any() and ((llama3[middle] < base[middle]) & (llama3[middle] > base[middle] / 8)).all()
    dynamic = RopeScaling("dynamic", 2.0, original_max_len=32)
    cos, sin = rope_tables(16, 64, 10000.0, scaling=dynamic)
    assert rope_for_length(cos, sin, 32, 10000.0, dynamic)[0] is cos  # unchanged up to the original length
    longer, _ = rope_for_length(cos, sin, 48, 10000.0, dynamic)
    assert longer.shape == (48, 8) and not torch.allclose(longer[40], cos[40])
    assert torch.equal(longer[:, 0], cos[:48, 0])  # theta^0 = 1: the fastest channel never changes


def test_flops_and_counts_leave_out_lookup_tables():
    gpt2, bert = make("gpt2"), make("bert")
    assert gpt2.num_params() - gpt2.num_params(exclude_embeddings=True) == 40 * 32  # positions only: tied
    assert bert.num_params() - bert.num_params(exclude_embeddings=True) == (40 + 2) * 32
    assert gpt2.flops_per_token(16) == 6 * gpt2.num_params(exclude_embeddings=True) + 12 * 2 * 32 * 16
    t5 = make("t5")  # 5 blocks of 4 heads x 6
    assert t5.flops_per_token(16) == 6 * t5.num_params(exclude_embeddings=True) + 12 * 5 * 24 * 16


def test_architecture_defaults_sit_under_user_values():
    cfg = load_config(None, ["--model.arch", "gpt2"])
    assert (cfg.model.activation, cfg.model.gated_ffn, cfg.model.tie_embeddings) == ("gelu_tanh", False, True)
    assert cfg.model.n_kv_heads == cfg.model.n_heads == 6
    assert load_config(None, ["--model.arch", "gpt2", "--model.tie_embeddings", "false"]).model.tie_embeddings is False
    bert = load_config(None, ["--model.arch", "bert", "--model.n_heads", "4"]).model
    assert bert.norm_eps == 1e-12 and bert.n_kv_heads == 4
    t5 = load_config(None, ["--model.arch", "t5", "--model.size", "small"]).model
    assert (t5.head_dim, t5.dim, t5.gated_ffn, t5.tie_embeddings) == (64, 512, True, False)
    assert load_config(None, ["--model.arch", "internlm2"]).model.rope_theta == 1e6
    assert load_config(None).model.activation == "silu"  # llama unchanged


@pytest.mark.parametrize("args, message", [
    (["--model.gated_ffn", "false"], "model.gated_ffn = false: llama's feed-forward is always gated"),
    (["--model.arch", "gpt2", "--model.rope_scaling", "linear"], "gpt2 has no RoPE"),
    (["--model.n_decoder_layers", "2"], "applies to encoder-decoder models (t5), not llama"),
    (["--model.arch", "bert", "--model.n_kv_heads", "2"], "bert has no grouped-query attention"),
    (["--model.rope_scaling", "llama3", "--model.rope_low_freq_factor", "4"], "needs 0 < model.rope_low_freq_factor"),
    (["--model.arch", "t5", "--model.rel_pos_buckets", "2"], "model.rel_pos_buckets >= 4"),
    (["--model.arch", "t5", "--model.size", "xl"], "model.size = 'xl' is not a preset of t5"),
    (["--model.activation", "tanh"], "model.activation = 'tanh' is not one of"),
])
def test_invalid_model_combinations_fail_at_start_up(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_internlm2_is_llama_with_packed_projections():
    model = make("internlm2")
    assert isinstance(model, InternLM2)
    wqkv = model.layers["0"].attention.wqkv.weight
    assert wqkv.shape == ((4 + 2 * 2) * 8, 32)
