"""benchmarks/tp_overlap.py keeps working: one round of the tiny preset at tp 2 with and without
SP, where the trainers with and without parallel.tp_overlap end at the same loss."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tp_overlap.py"


def test_one_round_of_each_layout_trains_the_same_losses_with_and_without_overlap():
    done = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--seq-len", "64", "--micro-batch", "4",
                           "--rounds", "1", "--steps", "1", "--warmup", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tp = 2")]
    assert len(rows) == 2
    for row in rows:
        off, on = re.search(r"\| ([\d.]+) / ([\d.]+) \|$", row).groups()
        assert off == on, row
