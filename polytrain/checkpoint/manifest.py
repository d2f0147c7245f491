"""A checkpoint's manifest: the size and BLAKE2b digest of every file it holds, so damage that
keeps a file's length (flipped bytes on a disk or in a copy) is found when loading instead of
silently becoming weights.

    manifest.json  {"format": "polytrain-manifest-1", "hash": "blake2b",
                    "files": {"__0_0.distcp": {"size": 1840902, "blake2b": "9f2c..."}, ...}}

write_checkpoint_dir writes it after every rank's files and before trainer.json (the completion
marker, whose own digest it also holds). The ranks hash the written tree in turns (file i of the
sorted listing by rank i % world size), so the work is spread and the result does not depend on
which rank wrote which file. BLAKE2b rather than CRC32: as fast in software on 64-bit CPUs, and
no accidental collision to argue about. A checkpoint without a manifest (written before it
existed) loads unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from polytrain.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
FORMAT = "polytrain-manifest-1"
_BLOCK = 1 << 20  # read 1 MiB at a time: memory stays flat whatever the shard's size


def digest_bytes(data: bytes) -> str:
    return hashlib.blake2b(data).hexdigest()


def digest_file(path: Path) -> str:
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _listing(root: Path) -> list[str]:
    """Every file under `root`, relative, sorted: the same list on every rank."""
    names = [os.path.relpath(os.path.join(d, name), root) for d, _, files in os.walk(root) for name in files]
    return sorted(Path(n).as_posix() for n in names)


def hash_share(root: Path, rank: int = 0, world_size: int = 1) -> dict[str, dict]:
    """{relative name: {"size", "blake2b"}} for this rank's share of the files under `root`."""
    return {name: {"size": (root / name).stat().st_size, "blake2b": digest_file(root / name)}
            for i, name in enumerate(_listing(root)) if i % world_size == rank}


def manifest_bytes(files: Mapping[str, dict]) -> bytes:
    return json.dumps({"format": FORMAT, "hash": "blake2b", "files": dict(sorted(files.items()))},
                      indent=1).encode()


def _read_manifest(path: Path) -> dict[str, dict] | None:
    file = path / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
        if record.get("format") != FORMAT or record.get("hash") != "blake2b":
            raise ValueError(f"format {record.get('format')!r}")
        files = dict(record["files"])
        if not all(isinstance(e.get("size"), int) and isinstance(e.get("blake2b"), str) for e in files.values()):
            raise ValueError("an entry lacks its size or digest")
        return files
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path} is damaged: {MANIFEST_FILE} cannot be read ({e}); "
                              "resume from an earlier one") from None


def verify(path: Path, rank: int = 0, world_size: int = 1) -> None:
    """Check this rank's share of the files `path`'s manifest lists; a CheckpointError names the
    first damaged one. Without a manifest (an older checkpoint) there is nothing to check."""
    path = Path(path)
    files = _read_manifest(path)
    for i, (name, expected) in enumerate(sorted((files or {}).items())):
        if i % world_size != rank:
            continue
        file = path / name
        try:
            size = file.stat().st_size
            what = (f"is {size} bytes, not {expected['size']}" if size != expected["size"] else
                    "does not match its checksum" if digest_file(file) != expected["blake2b"] else None)
        except FileNotFoundError:
            what = "is missing"
        except OSError as e:
            what = f"cannot be read ({e.strerror or e})"
        if what:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} {what} ({MANIFEST_FILE}); "
                                  "resume from an earlier one, or copy the checkpoint again")
