"""A worker killed (SIGKILL) while writing a checkpoint: the next run resumes from the previous one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import train_rows

pytestmark = pytest.mark.slow


def polytrain(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polytrain.cli", "train", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_kill_during_checkpoint_then_resume(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_overrides(small_corpus, run_dir, checkpoint__every=5, checkpoint__keep=0) + [
        "--parallel.nproc", "2", "--parallel.zero", "3"]

    crashed = polytrain(*args, env={"POLYTRAIN_TEST_KILL_DURING_SAVE": "10"})
    assert crashed.returncode == 1, crashed.stderr
    assert "killed by signal 9" in crashed.stderr
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step_5" / "trainer.json").is_file()
    assert not (checkpoints / "step_10").exists()  # the half-written save never looks complete
    assert (checkpoints / ".tmp-step_10").is_dir()
    before = {r["step"]: r["loss"] for r in train_rows(run_dir)}

    resumed = polytrain(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_5" in resumed.stdout
    assert (checkpoints / "step_10" / "trainer.json").is_file()
    assert not (checkpoints / ".tmp-step_10").exists()
    after = {r["step"]: r["loss"] for r in train_rows(run_dir)}
    assert sorted(after) == list(range(1, 11))
    # Steps 6-10 were trained twice, from the same state: the same losses.
    for step in range(6, 11):
        assert after[step] == pytest.approx(before[step], rel=1e-6)
