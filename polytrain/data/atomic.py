"""Atomic file writes: a reader sees the old file or the complete new one, never a half file.

Several ranks may prepare the same cache entry at once, and a run may be killed mid-write;
writing to a unique temporary name in the same directory and then `os.replace`-ing it onto
the final name makes both harmless (the rename is atomic within one file system).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on error it is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid + random suffix: concurrent writers of the same target never share a temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
