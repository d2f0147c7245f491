"""benchmarks/host_kernel_versions.py keeps working: a reduced run against HEAD builds the kernel
twice under two operator names and reports every shape and row count, the two builds of one
source agreeing bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.backend import host_matmul

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_kernel_versions.py"


@pytest.mark.skipif(not host_matmul.available(), reason="the host kernel cannot be built here")
def test_a_reduced_run_against_head_reports_every_shape_with_equal_outputs():
    done = subprocess.run([sys.executable, str(SCRIPT), "--base", "HEAD", "--rounds", "1", "--megabytes", "4",
                           "--rows", "1,3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 5 * 2
    assert all(line.rstrip().endswith("| 0.0e+00 |") for line in rows)
