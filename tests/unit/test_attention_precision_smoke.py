"""benchmarks/attention_precision.py keeps working: a reduced run prints a row per shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_precision.py"


def test_a_reduced_run_reports_every_shape():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--shapes", "2,2,64,16;1,2,32,8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 2, 2, 64, 16 |")
            or line.startswith("| 1, 2, 32, 8 |")]
    assert len(rows) == 2
