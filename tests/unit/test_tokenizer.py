"""Byte-level BPE training, exact round trips, save/load, and tokenizer errors."""

import random

import pytest
import tokenizers

from polytrain.data import EOT, Tokenizer, train_bpe
from polytrain.errors import ConfigError

WORDS = "the model trains on tokens while gradients flow back through layers of attention".split()


def sample_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 40))) + ".\n" for _ in range(n)]


TRICKY = [
    "",
    "def f(x):\r\n\treturn x  # tabs, CRLF and trailing spaces   \n",
    "naïve café — 数据 🚀 \u00a0nbsp and \x00 nul",
    "a literal <|endoftext|> inside a document",
    "\n\n\n   leading blank lines",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_bpe(sample_texts(300), 300)


def test_bpe_vocab_and_eot(tok):
    assert tok.eot_id == 0
    assert tok.hf.id_to_token(0) == EOT
    assert 257 < tok.vocab_size <= 300


@pytest.mark.parametrize("text", TRICKY + sample_texts(3, seed=9))
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_text_never_produces_eot(tok):
    ids = tok.encode("x <|endoftext|> y")
    assert tok.eot_id not in ids
    assert tok.decode(ids + [tok.eot_id]) == "x <|endoftext|> y" + EOT


def test_merges_compress_training_text(tok):
    text = sample_texts(1, seed=5)[0]
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_encode_batch_matches_encode(tok):
    texts = TRICKY + sample_texts(20, seed=3)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_training_is_deterministic(tok):
    assert train_bpe(sample_texts(300), 300).fingerprint == tok.fingerprint
    assert train_bpe(sample_texts(300), 280).fingerprint != tok.fingerprint


def test_save_load(tok, tmp_path):
    path = tmp_path / "sub" / "tokenizer.json"
    tok.save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokenizer.json"]  # no temp files left
    loaded = Tokenizer.load(path)
    assert loaded.fingerprint == tok.fingerprint
    assert loaded.vocab_size == tok.vocab_size and loaded.eot_id == tok.eot_id
    for text in TRICKY:
        assert loaded.encode(text) == tok.encode(text)


def test_too_small_vocab():
    with pytest.raises(ConfigError, match=r"model.vocab_size = 256 is too small .* at least 257"):
        train_bpe(["abc"], 256)


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not a valid tokenizer.json"):
        Tokenizer.load(bad)


def test_tokenizer_without_eot_is_rejected():
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ConfigError, match="no end-of-text token"):
        Tokenizer(hf)


def test_other_eot_names_are_found():
    vocab = {"a": 0, "</s>": 1, "[UNK]": 2}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.add_special_tokens(["</s>"])
    assert Tokenizer(hf).eot_id == 1
