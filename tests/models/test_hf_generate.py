"""Greedy KV-cached generation matches transformers' `generate` token for token.

Single prompts, equal-length batches, and batches of prompts of different lengths
(left-padded on both sides: polytrain's cache gives each row its own positions and
hides padding, as transformers does with an attention mask).
"""

from __future__ import annotations

import pytest
import torch

from polytrain.convert import load_hf
from polytrain.inference.generate import generate, generate_seq2seq
from tests.models import hf_models

NEW = 12


def prompts(vocab: int, lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, batch: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of left-padded prompts (pad id 0, masked)."""
    longest = max(map(len, batch))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                      pad_token_id=0)
    return out[:, longest:].tolist()


CASES = {
    "gpt2": lambda tmp: (hf_models.gpt2(n_positions=48), None),
    "llama-gqa": lambda tmp: (hf_models.llama(), None),
    "llama-tied-llama3": lambda tmp: (hf_models.llama(tie_word_embeddings=True, num_key_value_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}), None),
    # InternLM2 from its packed checkpoint, against the same weights as an HF Llama.
    "internlm2": lambda tmp: (hf_models.llama(num_attention_heads=6, hidden_size=36, num_key_value_heads=2),
                              "internlm2"),
}


@pytest.mark.parametrize("lengths", [[7], [9, 9], [3, 11, 6]], ids=["one", "equal", "ragged"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_matches_transformers(case, lengths, tmp_path):
    hf, layout = CASES[case](tmp_path)
    if layout == "internlm2":
        model, _ = load_hf(hf_models.internlm2_dir(hf, tmp_path / "hf"))
    else:
        model, _ = load_hf(hf_models.save(hf, tmp_path / "hf"))
    batch = prompts(hf.config.vocab_size, lengths)
    ours = generate(model, batch, NEW, temperature=0)
    assert ours == hf_greedy(hf, batch)


@pytest.mark.parametrize("kw", [{}, dict(untied=True, feed_forward_proj="gated-gelu", d_kv=6)],
                         ids=["t5-v1.0", "t5-v1.1"])
def test_t5_greedy_generation_matches_transformers(kw, tmp_path):
    """Encoder-decoder: prompts of different lengths, right-padded and masked; the decoder from id 0.

    (transformers 5.24's generate fails for num_decoder_layers != num_layers; the logits tests
    cover that shape.)
    """
    hf = hf_models.t5(**kw)
    model, _ = load_hf(hf_models.save(hf, tmp_path / "hf"))
    batch = prompts(hf.config.vocab_size, [6, 13, 9])
    longest = max(map(len, batch))
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in batch])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in batch])
    theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False)[:, 1:].tolist()  # after the start token
    assert generate_seq2seq(model, batch, NEW, temperature=0, start_token=0) == theirs


@pytest.mark.parametrize("case", ["gpt2", "llama-gqa"])
def test_static_cache_refilled_as_rows_finish_matches_transformers(case, tmp_path):
    """A static cache of 2 rows for 3 prompts (the third refills a finished row) gives
    transformers' tokens; the compiled step equals this path (tests/unit/test_generate.py)."""
    hf, _ = CASES[case](tmp_path)
    model, _ = load_hf(hf_models.save(hf, tmp_path / "hf"))
    batch = prompts(hf.config.vocab_size, [3, 11, 6])
    assert generate(model, batch, NEW, temperature=0, batch_size=2) == hf_greedy(hf, batch)
