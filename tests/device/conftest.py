"""The device tier: polytrain on an accelerator other than the CPU, against the CPU's results.

It runs on the accelerator POLYTRAIN_DEVICE_TIER names (default: testdev, polytrain's own test
device, tests/accelerator); a vendor runs it on theirs with POLYTRAIN_DEVICE_TIER=<name>
(docs/PORTING.md). Where the test device cannot be built (no compiler) the tier is skipped,
saying why; a device named explicitly that is not usable fails the tier instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TIER_ENV = "POLYTRAIN_DEVICE_TIER"
TEST_DEVICE = "testdev"
TEST_DEVICE_DIR = Path(__file__).parents[1] / "accelerator"
"""On sys.path, this directory is the test device's installation (its dist-info declares the
polytrain.accelerators entry point)."""
PROBE = "from polytrain.backend import get_accelerator; print(get_accelerator().describe())"


def tier_environment() -> dict[str, str]:
    """The environment a process of the tier runs in: the accelerator selected by name, the
    test device importable."""
    name = os.environ.get(TIER_ENV, TEST_DEVICE).strip().lower()
    env = {"POLYTRAIN_ACCELERATOR": name}
    if name == TEST_DEVICE:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TEST_DEVICE_DIR), os.environ.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="session")
def tier_env() -> dict[str, str]:
    """tier_environment(), once the accelerator has been shown to load in a process of its own
    (for the test device: built, ~1 min the first time on a machine). The test process itself
    stays on the CPU."""
    env = tier_environment()
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=900,
                           env={**os.environ, **env})
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        if env["POLYTRAIN_ACCELERATOR"] == TEST_DEVICE and os.environ.get(TIER_ENV) is None:
            pytest.skip(f"the test device could not be built or loaded: {why}")
        pytest.fail(f"{TIER_ENV}={env['POLYTRAIN_ACCELERATOR']} is not usable: {why}")
    return env


@pytest.fixture
def on_tier(tier_env, monkeypatch) -> dict[str, str]:
    """Processes this test starts (ranks, subprocesses) run on the tier's accelerator; this
    process stays on the CPU, where it computes the references: its accelerator is chosen (and
    cached) before the variable changes."""
    from polytrain.backend import get_accelerator

    assert get_accelerator().name == "cpu", "the tier's references are the CPU's"
    for key, value in tier_env.items():
        monkeypatch.setenv(key, value)
    if tier_env["POLYTRAIN_ACCELERATOR"] == TEST_DEVICE:  # spawned ranks take this sys.path
        monkeypatch.syspath_prepend(str(TEST_DEVICE_DIR))
    return tier_env
