"""benchmarks/host_gemm.py keeps working: a reduced run prints a row per shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_gemm.py"


def test_a_reduced_run_reports_every_shape():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--shapes", "64,32,48;16,8,8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| 64, 32, 48 |", "| 16, 8, 8 |"))]
    assert len(rows) == 2
