"""Document sources: the Python standard library, a .txt, .jsonl, .parquet or .arrow file, a
directory of them, or a Hugging Face dataset.

A document is (name, text). Names are stable across machines (paths relative to the source,
'/'-separated) because the train/validation split hashes them:

- 'stdlib': every .py file under the running Python's stdlib (site-/dist-packages excluded),
  in sorted order; the name is the path relative to the stdlib root, e.g. 'json/decoder.py'.
- .txt: the file is cut into documents of about 1 MiB at blank lines (paragraph breaks), so
  the split has more than one document to choose from; names are '<file>#<chunk>'.
- .jsonl: one document per line, from its string field `text_field` ("text"); names are
  '<file>:<line>'.
- .parquet, .arrow: one document per row, from its string column `text_field`; names are
  '<file>:<row>' (tabular.py, which also reads 'hf:NAME[:CONFIG][:SPLIT]' through `datasets`).
- a directory: all .txt, .jsonl, .parquet and .arrow files below it, in sorted order, read as above.

Files are read as UTF-8; undecodable bytes become U+FFFD rather than stopping a run.
Empty documents are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from polytrain.data import tabular
from polytrain.errors import ConfigError

CHUNK_CHARS = 1 << 20
"""A .txt document ends at the first blank line after this many characters."""
MAX_CHUNK_CHARS = 4 << 20
"""...or at the first line end after this many, for text without blank lines."""

SUPPORTED = (
    "'stdlib', a .txt, .jsonl, .parquet or .arrow file (text in data.text_field), a directory of "
    "them, hf:NAME[:CONFIG][:SPLIT] (Hugging Face Datasets), or a prepared .bin"
)
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")


class Document(NamedTuple):
    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """A re-iterable stream of documents plus a cheap identity used in cache keys."""

    kind: str
    """'stdlib', 'txt', 'jsonl', 'parquet', 'arrow', 'hf' or 'dir'."""
    identity: dict[str, Any]
    """Changes whenever the documents may have changed (file list, sizes, mtimes)."""
    _read: Callable[[], Iterator[Document]]

    def documents(self) -> Iterator[Document]:
        """Every non-empty document, in a fixed order; each call reads the source again."""
        return (doc for doc in self._read() if doc.text)


def open_corpus(source: str, text_field: str = "text") -> Corpus:
    """The corpus `source` names (see the module docstring); ConfigError if it cannot be read.

    `text_field`: the field (.jsonl) or column (.parquet, .arrow, hf:) holding the text."""
    if source == "stdlib":
        return _stdlib_corpus()
    if source.startswith(tabular.HF_PREFIX):
        return _hf_corpus(source, text_field)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data.source: {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(f"data.source: directory {path} holds no {', '.join(TEXT_SUFFIXES)} files")
        named = [(p.relative_to(path).as_posix(), p) for p in files]
        return Corpus("dir", _files_identity("dir", path, files, text_field),
                      lambda: (doc for name, p in named for doc in _read_file(p, name, text_field)))
    if path.suffix in TEXT_SUFFIXES:
        return Corpus(path.suffix[1:], _files_identity(path.suffix[1:], path, [path], text_field),
                      lambda: _read_file(path, path.name, text_field))
    if path.suffix == ".bin":
        raise ConfigError(f"data.source: {path} is already tokenized; it is not a text corpus")
    raise ConfigError(
        f"data.source: {path} has an unsupported kind '{path.suffix}'; use {SUPPORTED}"
    )


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _files_identity(kind: str, root: Path, files: list[Path], text_field: str) -> dict[str, Any]:
    stats = [(p, p.stat()) for p in files]
    identity = {
        "kind": kind,
        "path": str(root.resolve()),
        "files": _digest([f"{p.as_posix()}\t{s.st_size}\t{s.st_mtime_ns}" for p, s in stats]),
    }
    if text_field != "text":  # only then, so the default keeps the keys (and caches) it had
        identity["text_field"] = text_field
    return identity


def _hf_corpus(source: str, text_field: str) -> Corpus:
    dataset, identity = tabular.open_hf_dataset(source)
    slices = tabular.hf_slices(dataset, text_field, source)
    name, _, split = tabular.parse_hf_source(source)
    prefix = f"hf:{Path(name).name}/{split}"

    def read() -> Iterator[Document]:
        for doc_name, text in tabular.rows_as_documents(slices(), prefix, source, text_field):
            yield Document(doc_name, text)

    return Corpus("hf", {**identity, "text_field": text_field}, read)


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's descent order; third-party packages are not stdlib.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    return found


def _stdlib_corpus() -> Corpus:
    files = _stdlib_files()
    identity = {
        "kind": "stdlib",
        "python": f"{sys.implementation.name}-{platform.python_version()}",
        # Names and sizes only: cheap to compute, and stdlib files do not change in place.
        "files": _digest([f"{name}\t{path.stat().st_size}" for name, path in files]),
    }

    def read() -> Iterator[Document]:
        for name, path in files:
            yield Document(name, path.read_text(encoding="utf-8", errors="replace"))

    return Corpus("stdlib", identity, read)


def _read_file(path: Path, name: str, text_field: str) -> Iterator[Document]:
    if path.suffix in (".parquet", ".arrow"):
        rows = tabular.rows_as_documents(tabular.record_slices(path, text_field), name, str(path), text_field)
        return (Document(doc_name, text) for doc_name, text in rows)
    return _read_jsonl(path, name, text_field) if path.suffix == ".jsonl" else _read_txt(path, name)


def _read_txt(path: Path, name: str) -> Iterator[Document]:
    # newline="" keeps '\r\n' as is, so the documents hold exactly the file's text.
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        chunk: list[str] = []
        size = index = 0
        for line in f:
            chunk.append(line)
            size += len(line)
            if (size >= CHUNK_CHARS and not line.strip()) or size >= MAX_CHUNK_CHARS:
                yield Document(f"{name}#{index}", "".join(chunk))
                chunk, size, index = [], 0, index + 1
        yield Document(f"{name}#{index}", "".join(chunk))


def _read_jsonl(path: Path, name: str, text_field: str) -> Iterator[Document]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"data.source: {path} line {lineno} is not valid JSON ({e})"
                ) from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f'data.source: {path} line {lineno} has no string field "{text_field}"'
                                  + ("" if text_field != "text" else " (another field: set data.text_field)"))
            yield Document(f"{name}:{lineno}", text)
