"""A Hugging Face Trainer script written for a GPU (fp16 with its GradScaler, pinned memory, a
torch.cuda memory report) trains unmodified under `polytrain run`."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the compat test extra installs accelerate")

SCRIPT = Path(__file__).parent / "programs" / "hf_trainer_cuda.py"


def test_gpu_trainer_script_trains(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "run", str(SCRIPT),
                           "--output_dir", str(tmp_path), "--max_steps", "12"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.search(r"^losses (.*)$", proc.stdout, re.M)[1].split()]
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0, losses
    # The Trainer took its CUDA path (fp16 needs a GPU there) with a live loss scaler.
    report = re.search(r"^device (\S+) fp16 (\w+) scaler (\w+) peak memory (\d+) MiB",
                       proc.stdout, re.M)
    assert report is not None, proc.stdout[-2000:]
    assert report.groups()[:3] == ("cuda:0", "True", "True") and int(report[4]) > 50
