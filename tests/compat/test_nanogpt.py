"""A nanoGPT-style trainer written for CUDA runs unmodified under `polytrain run`, and its
losses equal those of the same script hand-edited for the CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "programs" / "nanogpt_cuda.py"

# What a person changes to port the script to the CPU by hand, keeping its numerics: each
# (old, new) must occur exactly once, so the test fails if the script drifts from its port.
CPU_EDITS = [
    ("import inspect\n", "import inspect\nimport resource\nimport time\n"),
    ("device = 'cuda'\n", "device = 'cpu'\n"),
    ("dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16'",
     "dtype = 'bfloat16'  # every CPU autocasts to bf16"),
    ("init_process_group(backend='nccl')", "init_process_group(backend='gloo')"),
    ("device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n", "device = 'cpu'\n"),
    ("ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(",
     "ctx = torch.amp.autocast("),
    ("torch.cuda.amp.GradScaler(enabled=", "torch.amp.GradScaler('cpu', enabled="),
    ("DDP(model, device_ids=[ddp_local_rank])", "DDP(model)"),
    ("    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
     "    start.record()\n", "    t0 = time.perf_counter()\n"),
    ("    end.record()\n    torch.cuda.synchronize()\n    dt = start.elapsed_time(end)\n",
     "    dt = (time.perf_counter() - t0) * 1000\n"),
    ("torch.cuda.max_memory_allocated() / 2**20",
     "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10"),
]
LINE = re.compile(r"iter (\d+): loss (\S+), time (\S+)ms, mem (\d+)MiB, dtype (\w+)")


@pytest.fixture(scope="module")
def cpu_script(tmp_path_factory) -> Path:
    text = SCRIPT.read_text()
    for old, new in CPU_EDITS:
        assert text.count(old) == 1, f"the CPU port's edit no longer applies: {old!r}"
        text = text.replace(old, new)
    assert "torch.cuda." not in text  # the port is complete
    path = tmp_path_factory.mktemp("nanogpt") / "nanogpt_cpu.py"
    path.write_text(text)
    return path


def train(argv: list[str]) -> list[tuple[float, float, int, str]]:
    """Run a trainer; returns (loss, ms, MiB, dtype) per iteration."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # both runs on the same threads: same sums
    proc = subprocess.run([sys.executable, *argv, "--max_iters=12"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [(float(m[2]), float(m[3]), int(m[4]), m[5]) for m in LINE.finditer(proc.stdout)]
    assert len(rows) == 12, proc.stdout
    return rows


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_losses_equal_the_hand_ported_cpu_script(dtype, cpu_script):
    extra = [f"--dtype={dtype}"] if dtype else []
    shimmed = train(["-m", "polytrain.cli", "run", str(SCRIPT), *extra])
    ported = train([str(cpu_script), *extra])
    # is_available() and is_bf16_supported() are True under the shim, so the script picks
    # bf16 by itself; fp16 runs GradScaler's scaling, unscale_ and step on the CPU.
    assert {row[3] for row in shimmed} == {dtype or "bfloat16"}
    assert [row[0] for row in shimmed] == [row[0] for row in ported]
    losses = [row[0] for row in shimmed]
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert all(ms > 0 for _, ms, _, _ in shimmed)  # torch.cuda.Event timed each step
    assert all(mib > 50 for _, _, mib, _ in shimmed)  # max_memory_allocated: the process's peak
