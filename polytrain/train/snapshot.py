"""Host-memory snapshots: checkpoints written to RAM (/dev/shm) every checkpoint.snapshot_every steps.

An elastic restart on the same machine resumes from the newest of the run's checkpoints and
its snapshots, so it loses at most snapshot_every steps instead of checkpoint.every. A
snapshot is an ordinary polytrain checkpoint (DCP, written atomically), so it reshards to
the new world size like any other; across nodes each node's RAM holds only its own ranks'
shards, which `check_checkpoint` finds incomplete, and the disk checkpoint is used instead.
The snapshots of a run are removed when it finishes.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from polytrain.errors import CheckpointError
from polytrain.train.checkpoint import check_checkpoint, latest_checkpoint

SHARED_MEMORY = Path("/dev/shm")


def snapshot_dir(run_dir: Path) -> Path:
    """Where this run's snapshots go: /dev/shm/polytrain/<hash of the run directory>, else <run dir>/snapshots."""
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK):
        return SHARED_MEMORY / "polytrain" / key
    return Path(run_dir) / "snapshots"


def newest_resume_point(run_dir: Path) -> Path | None:
    """The newest complete checkpoint or snapshot of the run (a snapshot missing shards is skipped)."""
    found = []
    for root in (Path(run_dir), snapshot_dir(run_dir)):
        path = latest_checkpoint(root)
        if path is None:
            continue
        try:
            check_checkpoint(path)
        except CheckpointError:
            continue
        found.append((int(re.search(r"(\d+)$", path.name).group(1)), root == Path(run_dir), path))
    return max(found)[2] if found else None  # a checkpoint wins a tie with a snapshot of its step
