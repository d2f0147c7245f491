"""Data parallel and ZeRO-3 reproduce the single-process run: same seed, data and global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-5


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_rows(run_dir) if "loss" in r]


def rows_after(run_dir: Path, step: int) -> list[dict]:
    """Training rows logged after `step` (what a run resumed from that step should reproduce)."""
    return [r for r in train_rows(run_dir) if r["step"] > step]


def train(overrides: list[str]) -> dict:
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    return Trainer(load_config(None, overrides)).train()


def _train_layouts(rank: int, world_size: int, layouts: list[list[str]]) -> None:
    for overrides in layouts:
        train(overrides)


def assert_same_trajectory(ref: list[dict], got: list[dict], rtol: float, what: str,
                           grad_norm_rtol: float | None = None) -> None:
    """Same steps, losses and gradient norms within `rtol` (the norms within `grad_norm_rtol` if given)."""
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    for a, b in zip(ref, got):
        for key, tol in (("loss", rtol), ("grad_norm", grad_norm_rtol or rtol)):
            assert b[key] == pytest.approx(a[key], rel=tol), f"{what}: {key} at step {a['step']}"


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("ref")
    train(tiny_overrides(small_corpus, run_dir))
    rows = train_rows(run_dir)
    assert len(rows) == 10 and rows[-1]["loss"] < rows[0]["loss"]
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_dp_and_zero3_match_single_process(world_size, reference, small_corpus, tmp_path):
    layouts = {
        "dp": [],
        "zero3": ["--parallel.zero", "3"],
    }
    if world_size == 4:
        layouts["hsdp"] = ["--parallel.zero", "3", "--parallel.zero_shard", "2"]
    runs = {name: tiny_overrides(small_corpus, tmp_path / name) + extra for name, extra in layouts.items()}
    run_ranks(world_size, _train_layouts, list(runs.values()))
    for name in runs:
        assert_same_trajectory(reference, train_rows(tmp_path / name), RTOL, f"{name} at {world_size} ranks")
