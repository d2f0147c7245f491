"""Resuming continues the exact run: 20 steps straight == 10 steps + resume + 10 steps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, rows_after, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow


def twenty_steps(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_overrides(corpus, run_dir, run__steps=20, checkpoint__every=10, checkpoint__keep=0) + list(extra)


def resume_from_step_10(straight_dir: Path, resumed_dir: Path) -> None:
    """A run directory holding only the straight run's step-10 checkpoint."""
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight_dir / "checkpoints" / "step_10", resumed_dir / "checkpoints" / "step_10")


def test_resume_continues_the_same_losses(small_corpus, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(twenty_steps(small_corpus, straight))
    resume_from_step_10(straight, resumed)
    summary = train(twenty_steps(small_corpus, resumed))
    assert summary["step"] == 20
    expected = rows_after(straight, 10)
    got = train_rows(resumed)
    assert [r["step"] for r in got] == list(range(11, 21))  # no row before the resume point
    assert_same_trajectory(expected, got, 1e-6, "resumed run")


def _train(rank, world_size, overrides):
    train(overrides)


def test_zero3_checkpoint_from_two_ranks_resumes_on_one(small_corpus, tmp_path):
    straight, resumed = tmp_path / "zero3x2", tmp_path / "single"
    run_ranks(2, _train, twenty_steps(small_corpus, straight, "--parallel.zero", "3"))
    resume_from_step_10(straight, resumed)
    train(twenty_steps(small_corpus, resumed))
    expected = rows_after(straight, 10)
    # Another layout sums in another order: the parity tolerance, not bitwise equality.
    assert_same_trajectory(expected, train_rows(resumed), 1e-5, "zero3 2 ranks -> 1 rank")
