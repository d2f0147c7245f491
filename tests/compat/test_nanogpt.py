"""A nanoGPT-style trainer written for CUDA runs unmodified under `polytrain run`, eager and
under torch.compile (inductor's C++ backend), and its losses equal those of the same script
hand-edited for the CPU; the shim adds no graph break."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.programs.nanogpt_cpu_port import SCRIPT, port_to_cpu

LINE = re.compile(r"iter (\d+): loss (\S+), time (\S+)ms, mem (\d+)MiB, dtype (\w+)")


@pytest.fixture(scope="module")
def cpu_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nanogpt") / "nanogpt_cpu.py"
    path.write_text(port_to_cpu(SCRIPT.read_text()))
    return path


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> Path:
    """One inductor cache for both runs of a test, shared with no other process."""
    return tmp_path_factory.mktemp("inductor")


def train(argv: list[str], cache: Path) -> list[tuple[float, float, int, str]]:
    """Run a trainer; returns (loss, ms, MiB, dtype) per iteration."""
    # Both runs on the same threads (same sums); Dynamo logs each graph break it makes.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_LOGS": "graph_breaks",
           "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, *argv, "--max_iters=12"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Graph break" not in proc.stderr, proc.stderr[-3000:]
    rows = [(float(m[2]), float(m[3]), int(m[4]), m[5]) for m in LINE.finditer(proc.stdout)]
    assert len(rows) == 12, proc.stdout
    return rows


# Eager with the dtype the script picks by itself (bf16: is_bf16_supported() under the shim),
# and nanoGPT's default torch.compile with fp16 autocast and GradScaler.
@pytest.mark.parametrize("dtype, compiled", [(None, False), ("float16", True)])
def test_losses_equal_the_hand_ported_cpu_script(dtype, compiled, cpu_script, inductor_cache):
    extra = [f"--compile={compiled}"] + ([f"--dtype={dtype}"] if dtype else [])
    shimmed = train(["-m", "polytrain.cli", "run", str(SCRIPT), *extra], inductor_cache)
    ported = train([str(cpu_script), *extra], inductor_cache)
    # is_available() and is_bf16_supported() are True under the shim, so the script picks
    # bf16 by itself; fp16 runs GradScaler's scaling, unscale_ and step on the CPU.
    assert {row[3] for row in shimmed} == {dtype or "bfloat16"}
    assert [row[0] for row in shimmed] == [row[0] for row in ported]
    losses = [row[0] for row in shimmed]
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert all(ms > 0 for _, ms, _, _ in shimmed)  # torch.cuda.Event timed each step
    assert all(mib > 50 for _, _, mib, _ in shimmed)  # max_memory_allocated: the process's peak
