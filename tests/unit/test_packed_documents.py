"""Packed documents through the decoders: document masks and explicit positions.

The reference for a packed row is each of its documents run alone through the same model.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from polytrain.config import ModelConfig
from polytrain.models import ARCHITECTURES
from polytrain.models.common.blockwise_attention import blockwise_core
from polytrain.models.common.documents import document_positions
from polytrain.models.common.init import init_plain
from polytrain.models.common.kv_cache import KVCache

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=32)
LENGTHS = [[5, 9, 6], [20]]  # two rows of 20 tokens: three documents, one


def _model(arch: str):
    cfg = dataclasses.replace(CFG, activation="gelu_tanh", n_kv_heads=4) if arch == "gpt2" else CFG
    model = ARCHITECTURES[arch].build(cfg)
    init_plain(model, 0)
    return model.double()


def _packed_row(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def test_document_positions_restart_at_each_document():
    ids = torch.stack([_packed_row(LENGTHS[0]), _packed_row(LENGTHS[1])])
    pos = document_positions(ids)
    assert pos[0].tolist() == list(range(5)) + list(range(9)) + list(range(6))
    assert pos[1].tolist() == list(range(20))


@pytest.mark.parametrize("arch", ["llama", "internlm2", "gpt2"])
def test_packed_rows_equal_their_documents_alone(arch):
    model = _model(arch)
    tokens = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    ids = torch.stack([_packed_row(row) for row in LENGTHS])
    logits = model(tokens, positions=document_positions(ids), documents=ids)
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            alone = model(tokens[b:b + 1, start:start + n])
            torch.testing.assert_close(logits[b:b + 1, start:start + n], alone, rtol=1e-10, atol=1e-10)
            start += n
    # Without the mask the documents do see each other: the check above can fail.
    assert not torch.allclose(model(tokens, positions=document_positions(ids)), logits)


def test_global_positions_of_a_slice_equal_the_slice_of_the_whole():
    """A later slice of a sequence with its own positions, attending to the whole prefix, is the
    whole sequence's rows (what a shard with global positions relies on); here via the cache."""
    model = _model("llama")
    tokens = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    whole = model(tokens)
    assert torch.allclose(model(tokens, positions=torch.arange(16)), whole, rtol=0, atol=0)
    shifted = model(tokens[:, 8:], positions=torch.arange(8, 16))  # no prefix keys: differs
    assert not torch.allclose(shifted, whole[:, 8:])
    cache = KVCache(1, 16)
    model(tokens[:, :8], cache=cache, start_pos=0)
    torch.testing.assert_close(model(tokens[:, 8:], cache=cache, start_pos=8, positions=torch.arange(8, 16)),
                               whole[:, 8:], rtol=1e-10, atol=1e-10)


def test_blockwise_core_in_the_model_equals_sdpa():
    model = _model("llama")
    tokens = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    ids = torch.stack([_packed_row(row) for row in LENGTHS])
    want = model(tokens, positions=document_positions(ids), documents=ids)
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for block in model.layers.values():
        block.attention.core = functools.partial(blockwise_core, causal=True, scale=None, block=6)
    got = model(tokens, positions=document_positions(ids), documents=ids)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-9, atol=1e-10, msg=n)


def test_documents_with_a_cache_is_refused():
    model = _model("llama")
    with pytest.raises(ValueError, match="KV cache"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=KVCache(1, 8), documents=torch.zeros(1, 4))
