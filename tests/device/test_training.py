"""Training on the tier's accelerator reproduces the CPU's losses: one process through the CLI,
and dp 2, ZeRO-3 with cpu offload, tp 2 and pp 2 in one 2-rank launch.

On the CPU, PyTorch's default device, a tensor made without `device=` or an index built on the
host goes unnoticed; on another device it fails, as on a GPU. Each layout here found such a
bug once: tp 2 indexed host rows with device indices at model build (distributed/shard_init.py),
ZeRO-3 with cpu offload multiplied host gradients by a device clip factor
(distributed/data_parallel.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-5  # the device runs CPU kernels, but not polytrain's host-only ones: rounding differs
STEPS = 6
LAYOUTS = {
    "dp": [],
    "zero3_offload": ["--parallel.zero", "3", "--parallel.offload", "cpu"],
    "tp": ["--parallel.tp", "2"],
    "pp": ["--parallel.pp", "2"],
}


@pytest.fixture(scope="module")
def cpu_reference(small_corpus, tmp_path_factory) -> list[dict]:
    """One process on the CPU (this test process's accelerator)."""
    run_dir = tmp_path_factory.mktemp("cpu")
    train(tiny_overrides(small_corpus, run_dir, run__steps=STEPS))
    rows = train_rows(run_dir)
    assert len(rows) == STEPS and rows[-1]["loss"] < rows[0]["loss"]
    return rows


def _train_layouts(rank: int, world_size: int, layouts: list[list[str]]) -> str:
    from polytrain.backend import get_accelerator

    for overrides in layouts:
        train(overrides)
    return get_accelerator().name


def test_one_process_trains_with_the_cpus_losses(on_tier, cpu_reference, small_corpus, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "train",
                           *tiny_overrides(small_corpus, tmp_path, run__steps=STEPS)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"| {on_tier['POLYTRAIN_ACCELERATOR']}: " in proc.stdout + proc.stderr  # the run's device line
    assert_same_trajectory(cpu_reference, train_rows(tmp_path), RTOL, "one process")


def test_layouts_train_with_the_cpus_losses(on_tier, cpu_reference, small_corpus, tmp_path):
    runs = {name: tiny_overrides(small_corpus, tmp_path / name, run__steps=STEPS) + extra
            for name, extra in LAYOUTS.items()}
    assert run_ranks(2, _train_layouts, list(runs.values())) == [on_tier["POLYTRAIN_ACCELERATOR"]] * 2
    for name in runs:
        assert_same_trajectory(cpu_reference, train_rows(tmp_path / name), RTOL, f"{name} on 2 ranks")
