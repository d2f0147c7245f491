"""The deterministic train/validation split, by document.

Rule: document `name` goes to validation when

    zlib.crc32(name.encode()) % 10000 < val_fraction * 10000

so a document keeps its side when other documents are added or removed. With
val_fraction > 0 neither side is left empty:

- no document hashes into validation -> the last document moves there;
- every document does -> the first document stays in training;
- the corpus is a single document -> it is split by position instead: the last
  val_fraction of its tokens are validation (see `split_tokens`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from polytrain.data.corpus import Document
from polytrain.errors import ConfigError


def hashed_to_val(name: str, val_fraction: float) -> bool:
    """The hash rule alone, before the never-empty adjustments."""
    return zlib.crc32(name.encode()) % 10000 < val_fraction * 10000


@dataclass(frozen=True)
class Split:
    """Where each document of one corpus goes; built by `plan_split`."""

    val_fraction: float
    n_documents: int
    train_chars: int
    """Characters of the training side (an estimate for a position split)."""
    to_val: str | None = None
    """Document moved to validation because none hashed there."""
    to_train: str | None = None
    """Document kept in training because all hashed to validation."""

    @property
    def by_position(self) -> bool:
        """A single document, split by token position rather than by document."""
        return self.n_documents == 1 and self.val_fraction > 0

    def is_val(self, name: str) -> bool:
        """Whether document `name` is validation (False for a position split's only document)."""
        if self.by_position or name == self.to_train:
            return False
        return name == self.to_val or hashed_to_val(name, self.val_fraction)


def plan_split(documents: Iterable[Document], val_fraction: float) -> Split:
    """One pass over the documents to apply the rule of the module docstring."""
    n = n_val = train_chars = 0
    first: Document | None = None
    last: Document | None = None
    for doc in documents:
        if first is None:
            first = doc
        last = doc
        n += 1
        if hashed_to_val(doc.name, val_fraction):
            n_val += 1
        else:
            train_chars += len(doc.text)
    if first is None or last is None:
        raise ConfigError("data.source holds no documents (every document is empty)")
    if n == 1:
        return Split(val_fraction, 1, round(len(first.text) * (1 - val_fraction)))
    if val_fraction > 0 and n_val == 0:
        return Split(val_fraction, n, train_chars - len(last.text), to_val=last.name)
    if n_val == n:
        return Split(val_fraction, n, len(first.text), to_train=first.name)
    return Split(val_fraction, n, train_chars)


def split_tokens(n_tokens: int, val_fraction: float) -> int:
    """How many trailing tokens of a single-document corpus are validation (at least 1, not all)."""
    return min(n_tokens - 1, max(1, round(n_tokens * val_fraction)))
