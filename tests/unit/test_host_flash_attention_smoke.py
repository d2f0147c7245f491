"""benchmarks/host_flash_attention.py keeps working: a reduced run times every way of running the
core for both training precisions, the kernel's error no larger than SDPA's own in that dtype."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.backend import host_matmul

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_flash_attention.py"


@pytest.mark.skipif(not host_matmul.available(), reason="the host kernels cannot be built here")
def test_a_reduced_run_reports_each_way_and_the_kernel_is_as_accurate():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--shapes", "1,4,2,80,32"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 1, 4, 2, 80, 32 |")]
    ways = [(cells[1].strip(), cells[2].strip()) for cells in rows]
    assert ways == [("fp32", "SDPA fp32"), ("fp32", "kernel"), ("bf16", "SDPA bf16"),
                    ("bf16", "SDPA on fp32 copies"), ("bf16", "kernel")]
    error = {way: float(cells[5]) for way, cells in zip(ways, rows)}
    assert error["fp32", "kernel"] <= 2 * error["fp32", "SDPA fp32"] + 1e-6
    assert error["bf16", "kernel"] <= 1.25 * error["bf16", "SDPA bf16"]
