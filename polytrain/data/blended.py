"""Pre-training on several corpora blended by weight (`data.sources`), as Megatron blends datasets.

    windows = training_windows(cfg.data, vocab_size, seed)   # data.sources, else data.source alone
    windows.train, windows.val, windows.tokenizer            # TokenDataset's interface either way

Every source is anything `data.source` accepts (a prepared .bin, a .txt/.jsonl file or
directory, 'stdlib'), tokenized once and cached like a single source, all with one
tokenizer: `data.tokenizer` when it is a path; else the tokenizer the prepared .bin
sources share; else a BPE trained once on all the text sources together. Training and
validation windows are each blended by the sources' weights (`blend.TokenBlend`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

from polytrain.config import DataConfig
from polytrain.data.blend import Source, TokenBlend, parse_sources
from polytrain.data.cache import _resolve_tokenizer, default_cache_dir, prepare_corpus
from polytrain.data.corpus import Corpus, Document, open_corpus
from polytrain.data.packed import PreparedCorpus, TokenDataset, load_prepared
from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import ConfigError


@dataclass
class Windows:
    """A run's training and validation windows and the tokenizer that made them."""

    train: TokenDataset | TokenBlend
    val: TokenDataset | TokenBlend
    tokenizer: Tokenizer
    parts: list[PreparedCorpus]
    """Each source's prepared token files, in source order."""


def training_windows(data_cfg: DataConfig, vocab_size: int, seed: int, cache_dir: Path | None = None) -> Windows:
    """The windows of `data.sources` blended by weight when it is set, else of `data.source`."""
    if data_cfg.sources:
        return prepare_blend(parse_sources(data_cfg.sources, "data.sources"), data_cfg, vocab_size, seed, cache_dir)
    prepared = prepare_corpus(data_cfg, vocab_size, cache_dir)
    seq = data_cfg.seq_len
    return Windows(TokenDataset(prepared.train_path, prepared.dtype, seq),
                   TokenDataset(prepared.val_path, prepared.dtype, seq), prepared.tokenizer, [prepared])


def _union(corpora: list[Corpus]) -> Corpus:
    """The text sources as one corpus (names prefixed by source position), to train one BPE on."""
    def read():
        return itertools.chain.from_iterable(
            (Document(f"{i}/{doc.name}", doc.text) for doc in c.documents()) for i, c in enumerate(corpora))

    return Corpus("blend", {"kind": "blend", "parts": [c.identity for c in corpora]}, read)


def shared_tokenizer(sources: list[Source], data_cfg: DataConfig, vocab_size: int, cache: Path) -> str:
    """Path of the one tokenizer.json every source is tokenized with (module docstring)."""
    if data_cfg.tokenizer != "bpe":
        return data_cfg.tokenizer
    bins = [s.path for s in sources if Path(s.path).suffix == ".bin"]
    if bins:
        if not Path(bins[0]).is_file():
            raise ConfigError(f"data.sources: {bins[0]} does not exist")
        tokenizer = load_prepared(bins[0]).tokenizer
    else:
        tokenizer = _resolve_tokenizer(data_cfg, _union([open_corpus(s.path, data_cfg.text_field) for s in sources]), vocab_size, cache)
    path = cache / "tokenizers" / f"shared-{tokenizer.fingerprint}.json"
    if not path.is_file():
        tokenizer.save(path)
    return str(path)


def prepare_blend(sources: list[Source], data_cfg: DataConfig, vocab_size: int, seed: int,
                  cache_dir: Path | None = None) -> Windows:
    """Every source tokenized (cached) with the shared tokenizer, train and val windows blended."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer = shared_tokenizer(sources, data_cfg, vocab_size, cache)
    parts = [prepare_corpus(dataclasses.replace(data_cfg, source=s.path, tokenizer=tokenizer), vocab_size, cache)
             for s in sources]
    names, weights, seq = [s.path for s in sources], [s.weight for s in sources], data_cfg.seq_len

    def windows(side: str) -> TokenBlend:
        sets = [TokenDataset(p.train_path if side == "train" else p.val_path, p.dtype, seq) for p in parts]
        return TokenBlend(sets, weights, seed, names=names, key="data.sources")

    return Windows(windows("train"), windows("val"), parts[0].tokenizer, parts)
