"""Logits of every architecture equal those of the transformers implementation (fp32, 1e-4).

Each HF model is saved as an HF directory and converted by polytrain's importer
(polytrain.convert.load_hf), so these tests cover the config mapping and the tensor
layout as well as the modules.
"""

from __future__ import annotations

import pytest
import torch

from polytrain.convert import load_hf
from tests.models import hf_models

TOL = 1e-4


def ids(vocab: int, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff < TOL, f"max |polytrain - transformers| = {diff}"


def convert(hf_model, tmp_path):
    model, _ = load_hf(hf_models.save(hf_model, tmp_path / "hf"))
    return model


@pytest.mark.parametrize("kw", [
    {},                                                                  # tied, gelu_new
    dict(n_layer=3, n_inner=48, vocab_size=97, activation_function="gelu", tie_word_embeddings=False),
], ids=["tied", "untied-gelu-odd-vocab"])
def test_gpt2_logits(kw, tmp_path):
    hf = hf_models.gpt2(**kw)
    x = ids(hf.config.vocab_size, 2, 40)
    with torch.no_grad():
        assert_close(convert(hf, tmp_path)(x), hf(input_ids=x).logits)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


@pytest.mark.parametrize("kw", [
    {},                                                                   # GQA 4/2, untied
    dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=103, rope_theta=500.0,
         rope_scaling=LLAMA3),                                            # MQA, tied, Llama-3.1 RoPE
    dict(head_dim=12, vocab_size=89, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(num_key_value_heads=4, max_position_embeddings=16, rope_theta=1e6,
         rope_scaling={"rope_type": "dynamic", "factor": 2.0}),           # past the original 16
], ids=["gqa-untied", "mqa-tied-llama3", "head-dim-linear", "dynamic-ntk"])
def test_llama_logits(kw, tmp_path):
    hf = hf_models.llama(**kw)
    x = ids(hf.config.vocab_size, 2, 30)
    with torch.no_grad():
        assert_close(convert(hf, tmp_path)(x), hf(input_ids=x).logits)


def test_llama3_scaling_changes_the_model(tmp_path):
    """The Llama-3.1 rule is really applied: the same weights without it give other logits."""
    scaled = hf_models.llama(rope_theta=500.0, rope_scaling=LLAMA3)
    plain = hf_models.llama(rope_theta=500.0)
    x = ids(101, 1, 30)
    with torch.no_grad():
        ours = convert(scaled, tmp_path)(x)
        assert (ours - plain(input_ids=x).logits).abs().max() > 1e-2
        assert_close(ours, scaled(input_ids=x).logits)


@pytest.mark.parametrize("kw", [
    dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
         max_position_embeddings=16, rope_theta=1e6),
    dict(num_attention_heads=6, hidden_size=36, num_key_value_heads=2, vocab_size=97, tie_word_embeddings=True),
], ids=["dynamic-ntk", "3-queries-per-kv-tied"])
def test_internlm2_logits(kw, tmp_path):
    """InternLM2 from its packed-wqkv checkpoint layout equals the same weights as an HF Llama."""
    reference = hf_models.llama(**kw)
    model, _ = load_hf(hf_models.internlm2_dir(reference, tmp_path / "internlm2"))
    x = ids(reference.config.vocab_size, 2, 30)
    with torch.no_grad():
        assert_close(model(x), reference(input_ids=x).logits)


@pytest.mark.parametrize("kw", [
    {},
    dict(num_hidden_layers=3, vocab_size=97, type_vocab_size=3, hidden_act="gelu_new", intermediate_size=40),
], ids=["base", "odd-vocab-3-types-gelu-tanh"])
def test_bert_mlm_logits(kw, tmp_path):
    hf = hf_models.bert(**kw)
    x = ids(hf.config.vocab_size, 3, 20)
    types = ids(hf.config.type_vocab_size, 3, 20, seed=2)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 14:] = 0  # a padded row
    mask[2, 5:] = 0
    with torch.no_grad():
        ours = convert(hf, tmp_path)(x, token_types=types, attention_mask=mask)
        theirs = hf(input_ids=x, token_type_ids=types, attention_mask=mask).logits
    real = mask.bool()  # padding positions' outputs are meaningless in both
    assert_close(ours[real], theirs[real])


@pytest.mark.parametrize("kw", [
    {},                                                                   # v1.0: ReLU, tied, scaled
    dict(untied=True, feed_forward_proj="gated-gelu", d_kv=6, num_decoder_layers=3, vocab_size=99),  # v1.1
    dict(relative_attention_num_buckets=8, relative_attention_max_distance=20, vocab_size=97),
], ids=["v1.0-relu-tied", "v1.1-gated-gelu-untied", "few-buckets-long-distance"])
def test_t5_logits(kw, tmp_path):
    hf = hf_models.t5(**kw)
    vocab = hf.config.vocab_size
    src, tgt = ids(vocab, 2, 45), ids(vocab, 2, 33, seed=2)
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[1, 30:] = 0  # the second source is padded
    with torch.no_grad():
        ours = convert(hf, tmp_path)(src, tgt, attention_mask=mask)
        theirs = hf(input_ids=src, decoder_input_ids=tgt, attention_mask=mask).logits
    assert_close(ours, theirs)


def test_pack_wqkv_is_the_layout_internlm2s_published_code_reads():
    """The fixture's packing against InternLM2's own reading of wqkv, not polytrain's: its modeling
    code splits the projection as rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=n_rep + 2),
    queries = [..., :n_rep, :], keys = [..., -2, :], values = [..., -1, :], and the public
    conversion scripts (e.g. lightllm's loader) reshape the weight to (Hkv, n_rep + 2, D, dim)
    the same way. Written here from that description."""
    heads, kv_heads, head_dim, dim = 8, 2, 4, 16
    q = torch.randn(heads * head_dim, dim)
    k, v = torch.randn(kv_heads * head_dim, dim), torch.randn(kv_heads * head_dim, dim)
    groups = hf_models.pack_wqkv(q, k, v, kv_heads).view(kv_heads, heads // kv_heads + 2, head_dim, dim)
    assert torch.equal(groups[:, :-2].reshape(-1, dim), q)
    assert torch.equal(groups[:, -2].reshape(-1, dim), k)
    assert torch.equal(groups[:, -1].reshape(-1, dim), v)
