"""A completed checkpoint survives a power cut: every file and directory is fsynced before the
rename that makes it visible, and every directory entry the save created (the new directory, a
new checkpoints/ directory in the run) is synced in its parent."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from polytrain.checkpoint import write_checkpoint_dir
from polytrain.io.atomic import write_bytes_atomic


def _record(monkeypatch) -> list[tuple]:
    """Log ("fsync", path) and ("replace", src, dst) in the order they happen."""
    events: list[tuple] = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def logged_replace(src, dst):
        events.append(("replace", Path(src), Path(dst)))
        return replace(src, dst)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    return events


def test_checkpoint_is_synced_before_and_after_its_rename(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    events = _record(monkeypatch)
    final = write_checkpoint_dir(run / "checkpoints" / "step_1", {"model": {"w": torch.ones(4)}},
                                 rank_files=lambda: {"rng/rank_0.pt": b"r"}, main_files=lambda: {"trainer.json": b"{}"})
    (rename,) = [i for i, e in enumerate(events) if e[0] == "replace"]
    tmp = events[rename][1]
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    written = [tmp / p.relative_to(final) for p in final.rglob("*")]
    assert written and set(written) | {tmp} <= synced_before  # files and directories, before the rename
    synced_after = {e[1] for e in events[rename:] if e[0] == "fsync"}
    assert final.parent in synced_after  # the rename itself
    # checkpoints/ did not exist: its entry in the run directory must be on disk as well.
    assert run in synced_before | synced_after


def test_atomic_write_syncs_the_directories_it_creates(tmp_path, monkeypatch):
    events = _record(monkeypatch)
    write_bytes_atomic(tmp_path / "a" / "b" / "f.bin", b"x")
    synced = {e[1] for e in events if e[0] == "fsync"}
    assert {tmp_path, tmp_path / "a", tmp_path / "a" / "b"} <= synced
    assert (tmp_path / "a" / "b" / "f.bin").read_bytes() == b"x"
