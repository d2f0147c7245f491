"""benchmarks/host_cross_entropy.py keeps working: a reduced run times both ways for both dtypes,
and their losses and gradients agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.backend import host_matmul

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_cross_entropy.py"


@pytest.mark.skipif(not host_matmul.available(), reason="the host kernels cannot be built here")
def test_a_reduced_run_reports_both_dtypes_with_agreeing_results():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--shapes", "300,48,500"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 300, 48, 500 |")]
    assert [cells[1].strip() for cells in rows] == ["float32", "bfloat16"]
    assert all(float(cells[5]) < 1e-5 for cells in rows)
