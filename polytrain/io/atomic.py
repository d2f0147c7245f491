"""Atomic, durable file writes: a reader sees the old file or the complete new one, never a half
file, and a completed write survives a crash or a power cut.

    with atomic_path(path) as tmp:      # write anything to tmp (a file or a directory)
        tmp.write_bytes(data)
    write_text_atomic(path, text)

Several ranks may prepare the same cache entry at once, and a run may be killed mid-write;
writing to a unique temporary name in the same directory, flushing it to disk (fsync), then
`os.replace`-ing it onto the final name and syncing the directory makes both harmless: the
rename is atomic within one file system, and the sync makes it (and the data it points at)
durable before anyone is told it happened.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    dirs = []
    for current, subdirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(current) / name)
        dirs.append(Path(current))
    for d in reversed(dirs):
        fsync_path(d)


def durable_mkdir(path: Path) -> None:
    """`mkdir -p path`, with each directory it creates recorded in its parent on disk: a
    rename into a new directory is not durable while that directory's own entry is not."""
    path = Path(path)
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
        fsync_path(d.parent)


def durable_replace(src: Path, dst: Path) -> None:
    """Rename `src` onto `dst` (a file or an empty-or-absent directory) and sync the parent
    (both parents when they differ: the rename changes the entries of each)."""
    os.replace(src, dst)
    fsync_path(dst.parent)
    if Path(src).parent.resolve() != Path(dst).parent.resolve():
        fsync_path(Path(src).parent)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    durable_mkdir(path.parent)
    # pid + random suffix: concurrent writers of the same target never share a temp file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if tmp.is_dir():
            fsync_tree(tmp)
        else:
            fsync_path(tmp)
        durable_replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically and durably."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically and durably."""
    write_bytes_atomic(path, text.encode("utf-8"))
