"""Packed token files: a corpus tokenized once into flat arrays, read back through np.memmap.

`prepare(source, tokenizer, out, val_fraction)` writes four files next to each other:

    out                      train tokens, flat little-endian uint16 (uint32 past 65536 ids)
    out.val.bin              validation tokens, same layout
    out.tokenizer.json       the tokenizer that produced them
    out.json                 sidecar: dtype, token counts, file names, source identity

Each document is followed by `<|endoftext|>`. Every file is written atomically and the
sidecar last, so a sidecar on disk means the three files it names are complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from polytrain.data.corpus import Document, open_corpus
from polytrain.data.split import Split, plan_split, split_tokens
from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import ConfigError
from polytrain.io.atomic import atomic_path, write_text_atomic

FORMAT = "polytrain.tokens/1"
BATCH_CHARS = 4 << 20
"""Characters handed to one encode_batch call: enough to keep the threads busy, bounded RAM."""


@dataclass
class PreparedCorpus:
    train_path: Path
    val_path: Path
    tokenizer: Tokenizer
    dtype: np.dtype
    n_train_tokens: int
    n_val_tokens: int


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id (< vocab_size) fits in it, else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def sibling_paths(out: Path) -> tuple[Path, Path, Path]:
    """(val tokens, tokenizer.json, sidecar json) that belong with train tokens `out`."""
    return out.with_suffix(".val.bin"), out.with_suffix(".tokenizer.json"), out.with_suffix(".json")


def _batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def prepare(source: str, tokenizer: Tokenizer, out: Path, val_fraction: float,
            text_field: str = "text") -> PreparedCorpus:
    """Tokenize every document of `source` once into `out` (train) and its siblings (module doc).

    Streams: documents are read, encoded and appended BATCH_CHARS at a time, so a source larger
    than memory (a big .jsonl, Parquet, Arrow, a Hugging Face dataset) never sits in RAM whole."""
    out = Path(out)
    if out.suffix != ".bin":
        raise ConfigError(f"prepared token file {out} must end in .bin")
    corpus = open_corpus(source, text_field)
    split = plan_split(corpus.documents(), val_fraction)
    dtype = token_dtype(tokenizer.vocab_size)
    val_path, tok_path, meta_path = sibling_paths(out)
    counts = {"train": 0, "val": 0}
    docs = {"train": 0, "val": 0}
    # Leaving the stack closes each file, then renames it onto its final name.
    with ExitStack() as stack:
        files = {
            side: stack.enter_context(stack.enter_context(atomic_path(path)).open("wb"))
            for side, path in (("train", out), ("val", val_path))
        }
        for batch in _batches(corpus.documents()):
            for doc, ids in zip(batch, tokenizer.encode_batch([d.text for d in batch])):
                tokens = np.asarray(ids + [tokenizer.eot_id], dtype=dtype)
                pieces = _place(doc, tokens, split)
                for side, piece in pieces:
                    piece.tofile(files[side])
                    counts[side] += len(piece)
                    docs[side] += 1
    tokenizer.save(tok_path)
    meta = {
        "format": FORMAT,
        "dtype": dtype.str,
        "train": {"file": out.name, "tokens": counts["train"], "documents": docs["train"]},
        "val": {"file": val_path.name, "tokens": counts["val"], "documents": docs["val"]},
        "tokenizer": tok_path.name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "val_fraction": val_fraction,
        "split": "position" if split.by_position else "document",
        "source": corpus.identity,
    }
    write_text_atomic(meta_path, json.dumps(meta, indent=1) + "\n")
    return PreparedCorpus(out, val_path, tokenizer, dtype, counts["train"], counts["val"])


def _place(doc: Document, tokens: np.ndarray, split: Split) -> list[tuple[str, np.ndarray]]:
    """Which file(s) a document's tokens go to: one side, or both for a position split."""
    if split.by_position:
        n_val = split_tokens(len(tokens), split.val_fraction)
        return [("train", tokens[:-n_val]), ("val", tokens[-n_val:])]
    return [("val" if split.is_val(doc.name) else "train", tokens)]


def load_prepared(path: str | Path) -> PreparedCorpus:
    """Open token files written by `prepare`, given the train .bin; checks they are complete."""
    path = Path(path)
    val_path, tok_path, meta_path = sibling_paths(path)
    if not meta_path.is_file():
        raise ConfigError(
            f"{path} is not a polytrain prepared file: missing {meta_path.name}; "
            "create it with `polytrain prepare`"
        )
    meta = read_sidecar(meta_path)
    dtype = np.dtype(meta["dtype"])
    train_path = path.with_name(meta["train"]["file"])
    val_path = path.with_name(meta["val"]["file"])
    for p, n in ((train_path, meta["train"]["tokens"]), (val_path, meta["val"]["tokens"])):
        size = p.stat().st_size if p.is_file() else -1
        if size != n * dtype.itemsize:
            raise ConfigError(f"{p} is missing or truncated ({size} bytes, {meta_path.name} says "
                              f"{n * dtype.itemsize}); prepare it again")
    tokenizer = Tokenizer.load(path.with_name(meta["tokenizer"]))
    return PreparedCorpus(train_path, val_path, tokenizer, dtype,
                          meta["train"]["tokens"], meta["val"]["tokens"])


def read_sidecar(meta_path: Path) -> dict:
    """The sidecar `prepare` wrote, with the fields `load_prepared` reads checked: ConfigError
    naming the file and the field if it is not JSON, truncated, or edited into another shape."""
    def damaged(what: str) -> ConfigError:
        return ConfigError(f"{meta_path} is damaged ({what}); prepare the data again with "
                           f"`polytrain prepare`")

    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise damaged(f"not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise damaged("not a JSON object")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("dtype") not in ("<u2", "<u4"):
        raise damaged(f"dtype {meta.get('dtype')!r} is not '<u2' or '<u4'")
    for side in ("train", "val"):
        entry = meta.get(side)
        if not isinstance(entry, dict) or not _plain_name(entry.get("file")):
            raise damaged(f"'{side}' needs a 'file' in the sidecar's directory")
        if not isinstance(entry.get("tokens"), int) or isinstance(entry["tokens"], bool) or entry["tokens"] < 0:
            raise damaged(f"'{side}.tokens' = {entry.get('tokens')!r} is not a token count")
    if not _plain_name(meta.get("tokenizer")):
        raise damaged("'tokenizer' needs a file name in the sidecar's directory")
    return meta


def _plain_name(name: object) -> bool:
    """A file name without directories: what `prepare` writes (its files sit side by side)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


class TokenDataset:
    """Non-overlapping windows of seq_len + 1 tokens over a token file (memory-mapped).

    Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1]: inputs are its first seq_len
    tokens, targets the last seq_len (the inputs shifted by one).
    """

    def __init__(self, path: str | Path, dtype: np.dtype | str, seq_len: int):
        self.path, self.dtype, self.seq_len = Path(path), np.dtype(dtype), seq_len
        n_tokens = self.path.stat().st_size // self.dtype.itemsize
        if n_tokens < seq_len + 1:
            raise ConfigError(
                f"{self.path} holds {n_tokens} tokens, too few for one sample of "
                f"data.seq_len = {seq_len} (+1 target); "
                f"data.seq_len must be smaller than {n_tokens}"
            )
        self.n_tokens = n_tokens
        # Read-only map: pages load on demand, so every rank shares the OS page cache.
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(n_tokens,))

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def get_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape (len(indices), seq_len)."""
        n = len(self)
        rows = []
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"sample {i} out of range for {n} samples")
            rows.append(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1])
        window = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T + 1)
        return window[:, :-1], window[:, 1:]
