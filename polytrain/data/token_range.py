"""Token ids outside the model's vocabulary, found when a prepared token file is opened.

An id at or above the vocabulary is an index error in the embedding on a CPU, and a
device-side assert (which kills the process) on a GPU, at whatever step first samples it;
found up front it is one line naming the file, the id and its position. The check is one
vectorised max over the memory map, a chunk at a time (bounded memory), once per version
of the file: the maximum is cached under `<cache>/token-max/`, keyed by the file's path,
size and modification time, so later runs and the other ranks of a job only read it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from polytrain.io.atomic import write_text_atomic
from polytrain.errors import ConfigError

CHUNK_TOKENS = 1 << 24
"""Tokens reduced at once: 32-64 MiB of ids."""


def check_token_range(path: Path, dtype: np.dtype, limit: int, cache_dir: Path) -> None:
    """ConfigError unless every id in the token file `path` is below `limit`: the ids the model's
    vocabulary leaves for data (model.vocab_size less any the objective reserves, e.g. [MASK])."""
    largest = max_token_id(path, dtype, cache_dir)
    if largest < limit:
        return
    position = _first_at_or_above(path, dtype, limit)
    if position is None:  # the cached maximum was stale: the file changed within one mtime tick
        return
    raise ConfigError(
        f"{path} holds token id {largest} (the first id >= {limit} is token {position:,}), but the "
        f"model's vocabulary leaves ids 0..{limit - 1} for data; raise model.vocab_size above "
        f"{largest}, or prepare the data again with the model's tokenizer (`polytrain prepare`)")


def max_token_id(path: Path, dtype: np.dtype, cache_dir: Path) -> int:
    """The largest id in the token file `path` (-1 if it is empty), computed once per file version."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\t{np.dtype(dtype).str}".encode())
    cached = Path(cache_dir) / "token-max" / f"{key.hexdigest()[:16]}.json"
    try:
        return int(json.loads(cached.read_text())["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tokens = _tokens(path, dtype)
    largest = max((int(tokens[i:i + CHUNK_TOKENS].max()) for i in range(0, len(tokens), CHUNK_TOKENS)),
                  default=-1)
    write_text_atomic(cached, json.dumps({"file": str(path), "max": largest}) + "\n")
    return largest


def _first_at_or_above(path: Path, dtype: np.dtype, limit: int) -> int | None:
    tokens = _tokens(path, dtype)
    for start in range(0, len(tokens), CHUNK_TOKENS):
        hits = np.flatnonzero(tokens[start:start + CHUNK_TOKENS] >= limit)
        if hits.size:
            return start + int(hits[0])
    return None


def _tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    n = path.stat().st_size // np.dtype(dtype).itemsize
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype=dtype)
