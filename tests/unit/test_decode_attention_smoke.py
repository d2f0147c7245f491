"""benchmarks/decode_attention.py keeps working: a reduced run prints a row per case, the
kernel's output within fp32 rounding of float64 attention."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_attention.py"


def test_a_reduced_run_reports_every_case():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--calls", "2", "--dtype", "fp32",
                           "--cases", "1:16:9,2:40:40", "--heads", "2:3:32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2
    assert all(float(row[-2]) < 1e-5 for row in rows)  # the kernel's largest difference, fp32
