"""Host-memory snapshots: checkpoints written to RAM (/dev/shm) every checkpoint.snapshot_every steps.

An elastic restart on the same machine resumes from the newest of the run's checkpoints and
its snapshots, so it loses at most snapshot_every steps instead of checkpoint.every. A
snapshot is an ordinary polytrain checkpoint (DCP, written atomically), so it reshards to
the new world size like any other; across nodes each node's RAM holds only its own ranks'
shards, so snapshots are only taken when every rank is on one machine (`snapshots_possible`).
They are removed when the run finishes; a run abandoned unfinished leaves its last one in
/dev/shm/polytrain/ (a later `polytrain train` of the same run directory resumes from it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from polytrain.errors import CheckpointError
from polytrain.checkpoint import check_checkpoint, latest_checkpoint

SHARED_MEMORY = Path("/dev/shm")


def snapshot_dir(run_dir: Path) -> Path | None:
    """Where this run's snapshots go: /dev/shm/polytrain/<the run directory's device and inode>, else
    <run dir>/snapshots; None while the run directory does not exist yet.

    Keyed on the directory's inode, not its path: a run directory deleted and made again (a fresh
    start under the same name) gets another, so a snapshot of the old run is never resumed.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    st = run_dir.stat()
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK):
        return SHARED_MEMORY / "polytrain" / f"{run_dir.name}-{st.st_dev:x}-{st.st_ino:x}"
    return run_dir / "snapshots"


def snapshots_possible() -> bool:
    """Whether every rank runs on this machine: a snapshot lives in one machine's memory."""
    return os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")


def newest_resume_point(run_dir: Path) -> Path | None:
    """The newest complete checkpoint or snapshot of the run (a snapshot missing shards is skipped)."""
    found = []
    for root in (Path(run_dir), snapshot_dir(run_dir)):
        path = latest_checkpoint(root) if root is not None else None
        if path is None:
            continue
        try:
            check_checkpoint(path)
        except CheckpointError:
            continue
        found.append((int(re.search(r"(\d+)$", path.name).group(1)), root == Path(run_dir), path))
    return max(found)[2] if found else None  # a checkpoint wins a tie with a snapshot of its step
