"""A DeepSpeed ZeRO-2 script written for CUDA runs unmodified on two CPU ranks under
`polytrain run --nproc 2`: with DeepSpeed's own CPU support doing the work (the shim points it
there through DS_ACCELERATOR), and with DeepSpeed's CUDA accelerator selected, where the shim
carries every CUDA call it makes."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the compat test extra installs DeepSpeed")

SCRIPT = Path(__file__).parent / "programs" / "deepspeed_zero2_cuda.py"


@pytest.mark.parametrize("selected", [None, "cuda"])
def test_zero2_script_trains_on_two_cpu_ranks(selected):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DS_ACCELERATOR", None)  # None: the shim must choose it
    if selected:
        env["DS_ACCELERATOR"] = selected
    # On its first run on a machine DeepSpeed compiles its shared-memory collectives for the
    # CPU (a minute or more on two cores); later runs load them from torch's extension cache.
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "run", "--nproc", "2", str(SCRIPT),
                           "--steps", "8"], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss (\d+\.\d{4}) time", proc.stdout)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    ranks = re.findall(r"rank (\d) zero_stage (\d) accelerator (\w+) backend (\w+) "
                       r"params (-?\d+\.\d{6})", proc.stdout)
    accelerator = selected or "cpu"
    assert sorted(r[:4] for r in ranks) == [("0", "2", accelerator, "gloo"),
                                            ("1", "2", accelerator, "gloo")]
    assert ranks[0][4] == ranks[1][4]  # ZeRO-2 all-gathered the same updated weights to both
