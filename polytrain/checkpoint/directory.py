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
4. rank 0 writes `main_files` (their presence marks a checkpoint complete), fsyncs every
   file and directory of the new tree, moves an older directory of the same name aside,
   renames the new one into place, syncs the parent directory, and removes the old one;
5. the ranks agree again (rank 0's outcome), so nobody returns before the checkpoint exists.

A crash at any point leaves either the old complete checkpoint or the new one, never a
half-written directory under the final name; the fsyncs before the rename make a completed
checkpoint survive a power cut.
"""

from __future__ import annotations

import io
import shutil
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from polytrain.errors import CheckpointError
from polytrain.io.atomic import durable_replace, fsync_path, fsync_tree

TMP_PREFIX = ".tmp-"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(error: str | None, what: str) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}")


def _describe(e: BaseException) -> str:
    # DCP collects per-rank exceptions in CheckpointException.failures; show the first.
    cause = next(iter(getattr(e, "failures", {}).values()), e)
    if isinstance(cause, BaseException):
        lines = str(cause).strip().splitlines()
        return lines[-1] if lines else type(cause).__name__
    return str(cause).strip().splitlines()[-1] if str(cause).strip() else "unknown error"


def torch_bytes(obj: Any) -> bytes:
    """`obj` as torch.save writes it, for `rank_files` / `main_files`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_checkpoint_dir(final: Path, tensors: Mapping[str, Any], *,
                         rank_files: Callable[[], Mapping[str, bytes]] | None = None,
                         main_files: Callable[[], Mapping[str, bytes]] | None = None) -> Path:
    """Write checkpoint `final` (see the module docstring); returns it. Collective.

    `tensors`: the state dict DCP saves (this rank's shards of it); `rank_files`: called on
    every rank after its shards are written, relative path -> bytes, written by this rank;
    `main_files`: called on rank 0 after every rank has written, written last.
    """
    final = Path(final)
    tmp = final.with_name(TMP_PREFIX + final.name)
    main = _rank() == 0
    error = None
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            error = f"cannot create {tmp}: {e.strerror or e}"
    _agree(error, f"saving checkpoint {final}")
    error = None
    try:
        dcp.save(dict(tensors), checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        for name, data in (rank_files() if rank_files else {}).items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            fsync_path(path)
    # A full disk, a permission, a failed pickle: all end the same way. DCP's own
    # CheckpointException is a BaseException, which `except Exception` would miss.
    except (Exception, CheckpointException) as e:
        error = _describe(e)
    try:
        _agree(error, f"saving checkpoint {final}")
    except CheckpointError:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if main:
        try:
            for name, data in (main_files() if main_files else {}).items():
                (tmp / name).write_bytes(data)
            fsync_tree(tmp)
            old = final.with_name(f".old-{final.name}")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                durable_replace(final, old)
            durable_replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            error = f"{e.strerror or e}" + (f" ({e.filename})" if getattr(e, "filename", None) else "")
            shutil.rmtree(tmp, ignore_errors=True)
        except Exception:
            error = traceback.format_exc().strip().splitlines()[-1]
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(error, f"saving checkpoint {final}")
    return final
