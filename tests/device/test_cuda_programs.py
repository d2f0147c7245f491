"""CUDA programs under `polytrain run` on the tier's accelerator: the shim maps torch.cuda onto
its device module and nccl onto its collective library."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
PROGRAMS = Path(__file__).parents[1] / "compat" / "programs"


def polytrain_run(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "run", *argv],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_cuda_basics_run_on_the_device(on_tier):
    name = on_tier["POLYTRAIN_ACCELERATOR"]
    proc = polytrain_run(str(PROGRAMS / "cuda_basics.py"))
    assert f"torch.cuda -> {name} ({name})" in proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["available"] is True and got["device"] == f"{name}:0"


def test_a_ddp_program_all_reduces_on_the_device(on_tier):
    proc = polytrain_run("--nproc", "2", str(PROGRAMS / "ddp_cuda.py"))
    ranks = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split()[:4] for line in ranks] == [["rank", "0", "device", "0"], ["rank", "1", "device", "1"]]
    assert len({line.split("params")[1] for line in ranks}) == 1  # one model after the all-reduce
