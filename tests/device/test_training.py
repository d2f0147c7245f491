"""Training on the tier's accelerator reproduces the CPU's losses: `polytrain train` in one
process and as tp 2 over 2 launched processes, and in one 2-rank launch dp 2, ZeRO-1 and ZeRO-2
(each also with cpu offload of the optimizer), ZeRO-3 (without offload, with cpu offload of the
optimizer, then of the parameters too), tp 2 (with sequence parallelism), pp 2, cp 2 (ring) and
LoRA over dp 2, then tp 2 resuming from the ZeRO-3 run's mid-run checkpoint (a checkpoint of
device tensors, another layout); in one 4-rank launch tp 2 x pp 2 and a 2D tensor-parallel grid.
The other architectures: tests/device/test_architectures.py.

On the CPU, PyTorch's default device, a tensor made without `device=` or an index built on the
host goes unnoticed; on another device it fails, as on a GPU. Each layout here found such a
bug once: tp 2 indexed host rows with device indices at model build (distributed/shard_init.py),
ZeRO-3 with cpu offload multiplied host gradients by a device clip factor
(distributed/data_parallel.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, rows_after, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-5  # the device runs CPU kernels, but not polytrain's host-only ones: rounding differs
STEPS = 6
LORA = ["--lora.rank", "4"]
LAYOUTS = {  # name: (overrides, whether LoRA trains)
    "dp": ([], False),
    "zero1": (["--parallel.zero", "1"], False),
    "zero1_offload": (["--parallel.zero", "1", "--parallel.offload", "cpu"], False),
    "zero2": (["--parallel.zero", "2"], False),
    "zero2_offload": (["--parallel.zero", "2", "--parallel.offload", "cpu"], False),
    "zero3": (["--parallel.zero", "3"], False),
    "zero3_offload": (["--parallel.zero", "3", "--parallel.offload", "cpu", "--checkpoint.every", str(STEPS // 2)],
                      False),
    "zero3_offload_params": (["--parallel.zero", "3", "--parallel.offload", "cpu",
                              "--parallel.offload_params", "cpu"], False),
    "tp": (["--parallel.tp", "2"], False),
    "tp_sp": (["--parallel.tp", "2", "--parallel.sp", "true"], False),
    "pp": (["--parallel.pp", "2"], False),
    "cp": (["--parallel.cp", "2"], False),
    "lora_dp": (LORA, True),
}


def cpu_run(corpus, run_dir, extra: list[str]) -> list[dict]:
    """One process on the CPU (this test process's accelerator)."""
    train(tiny_overrides(corpus, run_dir, run__steps=STEPS) + extra)
    rows = train_rows(run_dir)
    assert len(rows) == STEPS and rows[-1]["loss"] < rows[0]["loss"]
    return rows


@pytest.fixture(scope="module")
def cpu_reference(small_corpus, tmp_path_factory) -> list[dict]:
    return cpu_run(small_corpus, tmp_path_factory.mktemp("cpu"), [])


def _train_layouts(rank: int, world_size: int, layouts: list[list[str]],
                   resume: tuple[Path, list[str]] | None = None) -> str:
    """Train each layout, then (`resume` = (checkpoint, overrides)) a run from a copy of a
    checkpoint a layout wrote."""
    import torch.distributed as dist

    from polytrain.backend import get_accelerator

    for overrides in layouts:
        train(overrides)
    if resume is not None:
        checkpoint, resumed = resume
        if rank == 0:
            run_dir = Path(resumed[resumed.index("--run.out_dir") + 1])
            shutil.copytree(checkpoint, run_dir / "checkpoints" / checkpoint.name)
        dist.barrier()
        train(resumed)
    return get_accelerator().name


@pytest.mark.parametrize("launch", [[], ["--parallel.nproc", "2", "--parallel.tp", "2"]], ids=["one_process", "tp2"])
def test_polytrain_train_has_the_cpus_losses(launch, on_tier, cpu_reference, small_corpus, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "train",
                           *tiny_overrides(small_corpus, tmp_path, run__steps=STEPS), *launch],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"| {on_tier['POLYTRAIN_ACCELERATOR']}: " in proc.stdout + proc.stderr  # the run's device line
    assert_same_trajectory(cpu_reference, train_rows(tmp_path), RTOL, f"polytrain train {' '.join(launch)}")


def test_layouts_train_with_the_cpus_losses(on_tier, cpu_reference, small_corpus, tmp_path):
    runs = [tiny_overrides(small_corpus, tmp_path / name, run__steps=STEPS) + extra
            for name, (extra, _) in LAYOUTS.items()]
    checkpoint = tmp_path / "zero3_offload" / "checkpoints" / f"step_{STEPS // 2}"
    resumed = tiny_overrides(small_corpus, tmp_path / "resumed", run__steps=STEPS) + ["--parallel.tp", "2"]
    assert run_ranks(2, _train_layouts, runs, (checkpoint, resumed)) == [on_tier["POLYTRAIN_ACCELERATOR"]] * 2
    lora_reference = cpu_run(small_corpus, tmp_path / "cpu_lora", LORA)
    for name, (_, lora) in LAYOUTS.items():
        reference = lora_reference if lora else cpu_reference
        assert_same_trajectory(reference, train_rows(tmp_path / name), RTOL, f"{name} on 2 ranks")
    assert_same_trajectory(rows_after(tmp_path / "zero3_offload", STEPS // 2), train_rows(tmp_path / "resumed"),
                           RTOL, "tp 2 resumed from a ZeRO-3 checkpoint")


def test_grids_of_four_ranks_train_with_the_cpus_losses(on_tier, cpu_reference, small_corpus, tmp_path):
    """tp 2 x pp 2, and tp 4 as a 2D (2 x 2) grid: one 4-rank launch."""
    grids = {"tp_pp": ["--parallel.tp", "2", "--parallel.pp", "2"],
             "tp_2d": ["--parallel.tp", "4", "--parallel.tp_mode", "2d"]}
    runs = [tiny_overrides(small_corpus, tmp_path / name, run__steps=STEPS) + extra for name, extra in grids.items()]
    assert run_ranks(4, _train_layouts, runs) == [on_tier["POLYTRAIN_ACCELERATOR"]] * 4
    for name in grids:
        assert_same_trajectory(cpu_reference, train_rows(tmp_path / name), RTOL, f"{name} on 4 ranks")
