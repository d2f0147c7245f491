"""From a DataConfig to ready token files: resolve source and tokenizer, cache both.

Cache layout (under $POLYTRAIN_CACHE, default ~/.cache/polytrain):

    tokenizers/bpe-<vocab>-<key>.json     BPE trained on one corpus's training documents
    tokens/<kind>-<key>.bin               token files written by `prepare` (+ siblings)
    token-max/<key>.json                  the largest id of a prepared .bin given as data.source

Each key hashes everything its entry depends on (corpus identity, vocabulary, split,
format versions), so a changed input gets a new entry and an unchanged one is reused
without tokenizing again. Entries are written atomically: ranks racing to fill the same
entry at worst repeat the work, and readers never see a partial file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers

from polytrain.config import DataConfig
from polytrain.data.corpus import Corpus, open_corpus
from polytrain.data.packed import PreparedCorpus, load_prepared, prepare
from polytrain.data.split import Split, plan_split
from polytrain.data.token_range import check_token_range
from polytrain.data.tokenizer import Tokenizer, train_bpe
from polytrain.errors import ConfigError

log = logging.getLogger(__name__)

BPE_VERSION = 1
"""Bump when train_bpe changes what it produces, to retire cached tokenizers."""
PACK_VERSION = 1
"""Bump when prepare changes what it writes, to retire cached token files."""
BPE_TRAIN_CHARS = 8_000_000
"""BPE trains on a deterministic subset of about this many characters (~5 s on 2 cores)."""


def default_cache_dir() -> Path:
    """$POLYTRAIN_CACHE, else ~/.cache/polytrain."""
    return Path(os.environ.get("POLYTRAIN_CACHE") or Path.home() / ".cache" / "polytrain")


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def prepare_corpus(
    data_cfg: DataConfig, vocab_size: int, cache_dir: Path | None = None
) -> PreparedCorpus:
    """Token files for `data_cfg` with ids below `vocab_size`, prepared once and then reused.

    Idempotent and safe to call from several processes at once; the trainer calls it on
    rank 0, then on every rank after a barrier, so only rank 0 does the work.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if Path(data_cfg.source).suffix == ".bin":
        return _use_prepared(data_cfg, vocab_size, cache)
    corpus = open_corpus(data_cfg.source, data_cfg.text_field)
    tokenizer = _resolve_tokenizer(data_cfg, corpus, vocab_size, cache)
    key = _key(PACK_VERSION, corpus.identity, tokenizer.fingerprint, data_cfg.val_fraction)
    out = cache / "tokens" / f"{corpus.kind}-{key}.bin"
    if out.with_suffix(".json").is_file():
        try:
            return load_prepared(out)
        except (ConfigError, OSError, ValueError, KeyError) as e:
            log.warning("cached token files %s unusable (%s); preparing them again", out, e)
    start = time.perf_counter()
    log.info("tokenizing %s into %s (once; later runs reuse it)", data_cfg.source, out)
    prepared = prepare(data_cfg.source, tokenizer, out, data_cfg.val_fraction, data_cfg.text_field)
    log.info("tokenized %d train + %d val tokens in %.1f s", prepared.n_train_tokens,
             prepared.n_val_tokens, time.perf_counter() - start)
    return prepared


def prepare_to(source: str, out: str | Path, *, tokenizer: str = "bpe", vocab_size: int,
               val_fraction: float, text_field: str = "text",
               cache_dir: Path | None = None) -> PreparedCorpus:
    """`polytrain prepare`: tokenize `source` once into `out` (.bin) for use as data.source."""
    if Path(out).suffix != ".bin" or Path(out).is_dir():
        raise ConfigError(f"the output path {out} must be a file name ending in .bin")
    data_cfg = DataConfig(source=source, tokenizer=tokenizer, val_fraction=val_fraction, text_field=text_field)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = open_corpus(source, text_field)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return prepare(source, _resolve_tokenizer(data_cfg, corpus, vocab_size, cache), Path(out), val_fraction,
                   text_field)


def _check_vocab(tokenizer: Tokenizer, vocab_size: int, what: str) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"{what} has {tokenizer.vocab_size} tokens but model.vocab_size = "
                          f"{vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")


def _load_user_tokenizer(path: str) -> Tokenizer:
    if not Path(path).is_file():
        raise ConfigError(f"data.tokenizer: {path} does not exist (use 'bpe' or a tokenizer.json)")
    return Tokenizer.load(path)


def _use_prepared(data_cfg: DataConfig, vocab_size: int, cache: Path) -> PreparedCorpus:
    """A prepared .bin brings its own tokenizer and split; data.tokenizer may only confirm it.

    Its ids are checked against `vocab_size` too: the file may come from another tokenizer,
    or have been damaged, and an id past the embedding fails only steps later (on a GPU as
    a device assert)."""
    if not Path(data_cfg.source).is_file():
        raise ConfigError(f"data.source: {data_cfg.source} does not exist")
    prepared = load_prepared(data_cfg.source)
    if data_cfg.tokenizer != "bpe":
        wanted = _load_user_tokenizer(data_cfg.tokenizer)
        if wanted.fingerprint != prepared.tokenizer.fingerprint:
            raise ConfigError(f"data.tokenizer {data_cfg.tokenizer} is not the tokenizer "
                              f"{data_cfg.source} was prepared with; leave data.tokenizer unset")
    _check_vocab(prepared.tokenizer, vocab_size, f"the tokenizer of {data_cfg.source}")
    for path in (prepared.train_path, prepared.val_path):
        check_token_range(path, prepared.dtype, vocab_size, cache)
    return prepared


def _resolve_tokenizer(
    data_cfg: DataConfig, corpus: Corpus, vocab_size: int, cache: Path
) -> Tokenizer:
    """data.tokenizer as a Tokenizer: a given tokenizer.json, or BPE trained once per corpus."""
    if data_cfg.tokenizer != "bpe":
        tokenizer = _load_user_tokenizer(data_cfg.tokenizer)
        _check_vocab(tokenizer, vocab_size, f"data.tokenizer {data_cfg.tokenizer}")
        return tokenizer
    key = _key(BPE_VERSION, tokenizers.__version__, corpus.identity, vocab_size,
               data_cfg.val_fraction, BPE_TRAIN_CHARS)
    path = cache / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
    if path.is_file():
        try:
            return Tokenizer.load(path)
        except ConfigError as e:
            log.warning("cached tokenizer unusable (%s); training it again", e)
    start = time.perf_counter()
    split = plan_split(corpus.documents(), data_cfg.val_fraction)
    tokenizer = train_bpe(bpe_training_texts(corpus, split, BPE_TRAIN_CHARS), vocab_size)
    tokenizer.save(path)
    log.info("trained a %d-token BPE on %s in %.1f s", tokenizer.vocab_size, data_cfg.source,
             time.perf_counter() - start)
    return tokenizer


def bpe_training_texts(corpus: Corpus, split: Split, max_chars: int) -> Iterator[str]:
    """Training-side texts, thinned to about `max_chars` by a hash of each document's name.

    Hashing (not taking the first documents) spreads the subset over the whole corpus, e.g.
    over every stdlib package rather than the alphabetically first ones.
    """
    rate = max_chars / max(1, split.train_chars)
    for doc in corpus.documents():
        if split.by_position:
            yield doc.text[: split.train_chars]  # the part whose tokens become training data
        elif not split.is_val(doc.name) and zlib.crc32(f"bpe:{doc.name}".encode()) < rate * 2**32:
            yield doc.text
