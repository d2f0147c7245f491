"""Where the peer frameworks with pins of their own live: each in a virtualenv of its own that
.ci/run creates and names in an environment variable (`POLYTRAIN_<PEER>_PYTHON`, its python)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def peer_python(peer: str) -> str:
    """The peer's python; skips on a developer's machine without it, fails in CI."""
    variable = f"POLYTRAIN_{peer.upper()}_PYTHON"
    python = os.environ.get(variable)
    if python and Path(python).is_file():
        return python
    if os.environ.get("CI"):
        pytest.fail(f"{variable} does not name a python: .ci/run creates the {peer} environment")
    pytest.skip(f"no {peer} environment: run .ci/run, or set {variable} to the python of a "
                f"virtualenv made as .ci/peer_envs.sh makes it")


def polytrain_run(python: str, argv: list[str], cwd: Path = ROOT,
                  timeout: float = 900) -> subprocess.CompletedProcess:
    """`polytrain run ARGV` with the peer's python and this checkout's polytrain."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([python, "-m", "polytrain.cli", "run", *argv], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=cwd)
