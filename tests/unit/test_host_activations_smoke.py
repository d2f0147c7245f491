"""benchmarks/host_activations.py keeps working: a reduced run times both ways for both dtypes,
and their outputs and gradients agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.backend import host_matmul

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_activations.py"


@pytest.mark.skipif(not host_matmul.available(), reason="the host kernels cannot be built here")
def test_a_reduced_run_reports_both_activations_and_dtypes_with_agreeing_results():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--shapes", "gelu_tanh:400,48;silu_mul:400,48"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith(("| gelu_tanh", "| silu_mul"))]
    assert [(cells[0].strip(), cells[2].strip()) for cells in rows] == [
        ("gelu_tanh", "float32"), ("gelu_tanh", "bfloat16"), ("silu_mul", "float32"), ("silu_mul", "bfloat16")]
    # fp32: fp32 rounding apart; bf16: one bf16 rounding (0.25 at 32-64) of values up to ~60 apart (torch
    # rounds silu(gate) before the product)
    assert all(float(cells[6]) < (1e-4 if cells[2].strip() == "float32" else 0.5) for cells in rows)
