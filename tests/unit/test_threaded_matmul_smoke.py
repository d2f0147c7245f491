"""benchmarks/threaded_matmul.py keeps working: a reduced run prints a row per shape and row
count, every split output bitwise equal to F.linear's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "threaded_matmul.py"


def test_a_reduced_run_reports_every_shape_and_equal_outputs():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--megabytes", "4", "--rows", "1,3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| (")]
    assert len(rows) == 5 * 2
    assert all(line.rstrip().endswith("| True |") for line in rows)
