"""The one routine that writes a checkpoint directory, collectively and atomically.

    write_checkpoint_dir(root / "step_100", {"model": ..., "optim": ...},
                         rank_files=lambda: {"rng/rank_0.pt": b"..."},   # this rank's own files
                         main_files=lambda: {"trainer.json": b"..."})    # rank 0's, written last

Every rank calls it. The steps:

1. rank 0 creates `.tmp-<name>/` next to the final directory (clearing a leftover);
2. every rank writes its shards with Distributed Checkpoint (which fsyncs them) and its
   `rank_files`;
3. the ranks agree that all of them succeeded (one all-gather of their errors), else every
   rank raises one CheckpointError naming the first rank that failed and why, and the
   temporary directory is removed: the previous checkpoint stays the newest complete one;
4. the ranks hash the tree in turns (manifest.py) and rank 0 gathers the digests;
5. rank 0 writes manifest.json, then `main_files` (their presence marks a checkpoint
   complete), fsyncs every file and directory of the new tree, moves an older directory of
   the same name aside, renames the new one into place, syncs the parent directory, and
   removes the old one;
6. the ranks agree again (rank 0's outcome), so nobody returns before the checkpoint exists.

A failure names the file that could not be written (a full disk, a permission) and says
that the previous checkpoint is intact, on every rank.

A crash at any point leaves either the old complete checkpoint or the new one, never a
half-written directory under the final name; the fsyncs before the rename make a completed
checkpoint survive a power cut.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from polytrain.checkpoint.manifest import MANIFEST_FILE, digest_bytes, hash_share, manifest_bytes
from polytrain.errors import CheckpointError
from polytrain.io.atomic import durable_mkdir, durable_replace, fsync_path, fsync_tree

TMP_PREFIX = ".tmp-"


def _rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _gather(obj: Any, group: Any = None) -> list[Any]:
    """`obj` of every rank of `group` (None: the default group), in rank order (just this
    rank's without a process group)."""
    if _world(group) == 1:
        return [obj]
    out: list[Any] = [None] * _world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _agree(error: str | None, what: str, group: Any = None) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    failed = [(rank, e) for rank, e in enumerate(_gather(error, group)) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")


def agree(fn: Callable[[], Any] | None, group: Any = None) -> Any:
    """Run `fn` on this rank (None: nothing), then agree: a CheckpointError on any rank is raised
    on every rank (the lowest failed rank's message); else `fn`'s result. Collective, like a
    barrier, and for the same reason as distributed.world.together (which this floor cannot
    import): a rank that fails alone would leave the others waiting at their next collective.
    """
    result, error = None, None
    try:
        result = fn() if fn is not None else None
    except CheckpointError as e:
        error = e
    first = next((m for m in _gather(None if error is None else str(error), group) if m is not None), None)
    if error is not None:
        raise error
    if first is not None:
        raise CheckpointError(first)
    return result


def _describe(e: BaseException) -> str:
    cause = dcp_cause(e)
    if isinstance(cause, OSError):
        return _os_error(cause)
    lines = str(cause).strip().splitlines()
    return lines[-1] if lines else type(cause).__name__


def dcp_cause(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (whose `failures` maps a rank
    to the exception, or to (exception, its stack)), else `e` itself."""
    cause = next(iter(getattr(e, "failures", {}).values()), e)
    if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
        cause = cause[0]
    return cause if isinstance(cause, BaseException) else e


def _os_error(e: OSError) -> str:
    """What the user can fix: which file, why, and that nothing was lost."""
    where = f"cannot write {e.filename}" if e.filename else "cannot write the checkpoint"
    return (f"{where} ({e.strerror or e}); free disk space or make the directory writable, then "
            "resume: the previous checkpoint is intact")


class _NamingFileSystem(FileSystem):
    """DCP's file system, with a write error that names its file: DCP writes through open
    streams, whose OSError (a full disk: ENOSPC / EFBIG) names none, and torch.save's writer
    even replaces it with a RuntimeError of its own ("unexpected pos")."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        recording = None
        try:
            with super().create_stream(path, mode) as stream:
                recording = _Recording(stream)
                yield recording  # type: ignore[misc]
        except Exception as e:
            cause = e if isinstance(e, OSError) else recording.error if recording else None
            if cause is None:
                raise
            cause.filename = cause.filename or str(path)
            raise cause from e


class _Recording:
    """A stream that keeps the OSError its last failed write raised."""

    def __init__(self, stream: Any):
        self._stream, self.error = stream, None

    def write(self, data: Any) -> Any:
        try:
            return self._stream.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _writer(tmp: Path) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(str(tmp))
    writer.fs = _NamingFileSystem()
    return writer


def torch_bytes(obj: Any) -> bytes:
    """`obj` as torch.save writes it, for `rank_files` / `main_files`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_checkpoint_dir(final: Path, tensors: Mapping[str, Any], *,
                         rank_files: Callable[[], Mapping[str, bytes]] | None = None,
                         main_files: Callable[[], Mapping[str, bytes]] | None = None,
                         group: Any = None) -> Path:
    """Write checkpoint `final` (see the module docstring); returns it. Collective over `group`.

    `tensors`: the state dict DCP saves (this rank's shards of it); `rank_files`: called on
    every rank after its shards are written, relative path -> bytes, written by this rank;
    `main_files`: called on rank 0 after every rank has written, written last; `group`: the
    process group of every collective (None: the default one; async saves pass their own,
    so that their collectives never interleave with training's).
    """
    final = Path(final)
    tmp = final.with_name(TMP_PREFIX + final.name)
    main = _rank(group) == 0
    error = None
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            durable_mkdir(tmp)  # a new checkpoints/ directory must itself survive a power cut
        except OSError as e:
            error = _os_error(e)
    _agree(error, f"saving checkpoint {final}", group)
    _collectively(tmp, main, lambda: _write_rank_part(tmp, tensors, rank_files, group), final, group)
    files = _collectively(tmp, main, lambda: hash_share(tmp, _rank(group), _world(group)), final, group)
    _collectively(tmp, main, (lambda: _finish(tmp, final, files, main_files)) if main else None, final, group)
    return final


def _collectively(tmp: Path, main: bool, step: Callable[[], Any] | None, final: Path,
                  group: Any = None) -> list[Any]:
    """Run `step` on this rank (None: nothing), then agree; returns every rank's result.

    On any rank's failure every rank raises the same CheckpointError and rank 0 removes the
    temporary directory: the previous checkpoint stays the newest complete one.
    """
    result, error = None, None
    try:
        result = step() if step is not None else None
    # A full disk, a permission, a failed pickle: all end the same way. DCP's own
    # CheckpointException is a BaseException, which `except Exception` would miss.
    except (Exception, CheckpointException) as e:
        error = _describe(e)
    gathered = _gather((result, error), group)
    failed = [(rank, e) for rank, (_, e) in enumerate(gathered) if e is not None]
    if failed:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        rank, message = failed[0]
        raise CheckpointError(f"saving checkpoint {final} failed on rank {rank}: {message}")
    return [r for r, _ in gathered]


def _write_rank_part(tmp: Path, tensors: Mapping[str, Any],
                     rank_files: Callable[[], Mapping[str, bytes]] | None, group: Any) -> None:
    """This rank's shards (DCP fsyncs them) and its own files."""
    dcp.save(dict(tensors), storage_writer=_writer(tmp), process_group=group, no_dist=not dist.is_initialized())
    for name, data in (rank_files() if rank_files else {}).items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        fsync_path(path)


def _finish(tmp: Path, final: Path, shares: list[dict[str, dict]],
            main_files: Callable[[], Mapping[str, bytes]] | None) -> None:
    """Rank 0: the manifest, the main files (last: they mark the checkpoint complete), fsync, rename."""
    extra = dict(main_files() if main_files else {})
    files = {name: entry for share in shares for name, entry in share.items()}
    files.update({name: {"size": len(data), "blake2b": digest_bytes(data)} for name, data in extra.items()})
    (tmp / MANIFEST_FILE).write_bytes(manifest_bytes(files))
    for name, data in extra.items():
        (tmp / name).write_bytes(data)
    fsync_tree(tmp)  # every file and directory is on disk before the rename makes them visible
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        durable_replace(final, old)
    durable_replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
