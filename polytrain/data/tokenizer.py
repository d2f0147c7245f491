"""Tokenizer: a thin wrapper over a HF `tokenizers` tokenizer, and byte-level BPE training.

Byte-level BPE round-trips any text exactly (`decode(encode(s)) == s`): the 256 byte symbols
are always in the vocabulary, and there is no normalizer.

Special tokens are never produced from text: a document that literally contains
'<|endoftext|>' encodes it as ordinary bytes, so only the data pipeline's own document
separators carry `eot_id`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from polytrain.errors import ConfigError
from polytrain.io.atomic import write_text_atomic

EOT = "<|endoftext|>"
# End-of-text tokens of common tokenizer.json files, tried in order for `eot_id`.
_EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
MIN_BPE_VOCAB = 257
"""256 byte symbols + <|endoftext|>."""


class Tokenizer:
    """encode/decode text; `eot_id` separates documents in the token stream."""

    def __init__(self, hf: tokenizers.Tokenizer):
        self.hf = hf
        self.hf.encode_special_tokens = True
        eot = next((i for n in _EOT_NAMES if (i := hf.token_to_id(n)) is not None), None)
        if eot is None:
            names = ", ".join(_EOT_NAMES)
            raise ConfigError(f"tokenizer has no end-of-text token (looked for {names})")
        self.eot_id: int = eot

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included; every id is below it."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """A short hash of the full tokenizer definition, for cache keys."""
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of text in which special tokens (a chat template's <|im_start|>, ...) are themselves."""
        self.hf.encode_special_tokens = False
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        finally:
            self.hf.encode_special_tokens = True

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel threads."""
        # encode_batch_fast skips character offsets, about twice as fast; tokenizers >= 0.20.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are written out (e.g. '<|endoftext|>')."""
        # int() so a tensor of ids works too.
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically."""
        write_text_atomic(Path(path), self.hf.to_str())

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a tokenizer.json; ConfigError if it is missing or not a tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} does not exist")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the binding raises bare Exception on malformed JSON
            raise ConfigError(f"{path} is not a valid tokenizer.json ({e})") from None
        return cls(hf)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with at most `vocab_size` ids; '<|endoftext|>' is id 0."""
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(
            f"model.vocab_size = {vocab_size} is too small for byte-level BPE; "
            f"it needs at least {MIN_BPE_VOCAB} (256 bytes + {EOT})"
        )
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return Tokenizer(hf)
