"""polytrain's own tests pass with the CUDA shim installed, as `polytrain run` installs it.

The whole suite: `python -m pytest --compat-shim` (tests/conftest.py). In CI, this test runs
a part that covers the kinds of work polytrain does, in a fresh pytest with the shim in it
and in every rank it spawns: the model built on the meta device, initialised and
recomputed, parameter and dropout random streams, the backends, and tensor parallelism with
pipeline stages on two gloo ranks against the single device. (The full run, which also
covers data parallelism, ZeRO and the end-to-end trainer, takes as long as the suite.)
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBSET = [
    "tests/unit/test_model.py",
    "tests/unit/test_dropout_rng.py",
    "tests/unit/test_backend.py",
    "tests/distributed/test_tensor_parallel.py::test_tp2_layers_and_pipeline_stages_match_single_device",
]


def test_polytrain_tests_pass_under_the_shim():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--compat-shim", "-p", "no:cacheprovider", "--durations=8",
                           *SUBSET], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "polytrain compat: torch.cuda -> cpu (cpu), nccl -> gloo" in proc.stdout, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
