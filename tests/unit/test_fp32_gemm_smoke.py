"""benchmarks/fp32_gemm.py and onednn_products.py keep working: one round of the tiny preset at tp 2
and ZeRO-2, where the trainers with their products on oneDNN and on the BLAS end at the same loss
(to fp32 rounding), and one round of two layers' products, equal to fp32 rounding."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.backend import host_gemm

pytestmark = pytest.mark.skipif(not host_gemm.onednn_available(), reason="this build of torch has no oneDNN")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "fp32_gemm.py"


def test_one_round_of_layer_products_reports_both_libraries_with_agreeing_results():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "onednn_products.py"), "--rounds", "1",
                           "--shapes", "64,32,48;40,96,16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith(("| 64, 32", "| 40, 96"))]
    assert len(rows) == 2
    assert all(float(cells[-1]) < 1e-4 for cells in rows)  # outputs and input gradients of unit size


@pytest.mark.slow
def test_one_round_of_each_layout_trains_the_same_losses_on_either_library():
    done = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--seq-len", "64", "--micro-batch", "4",
                           "--rounds", "1", "--steps", "1", "--warmup", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| tp = 2", "| ZeRO-2"))]
    assert len(rows) == 2
    for row in rows:
        blas, onednn = (float(x) for x in re.search(r"\| ([\d.]+) / ([\d.]+) \|$", row).groups())
        assert abs(blas - onednn) <= 1e-4 * blas, row
