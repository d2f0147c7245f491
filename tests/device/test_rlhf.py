"""RLHF's three steps on the tier's accelerator reproduce the CPU's: step 3 generates with the
device's generator, scores with the reward model and trains actor and critic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.test_rlhf import _args, _step_rows

pytestmark = pytest.mark.slow
RTOL = 1e-5
COMPARED = ("reward", "kl", "entropy", "response_len", "policy_loss", "grad_norm", "value_loss", "critic_grad_norm")


def rlhf_steps(run_dir, *argv: str) -> list[list[str]]:
    return [_args(run_dir, "--rlhf.steps", "1,2", *argv), _args(run_dir, "--rlhf.steps", "3", *argv)]


def test_rlhf_step_3_has_the_cpus_metrics(on_tier, tmp_path):
    from polytrain.cli import main

    for argv in rlhf_steps(tmp_path / "cpu"):
        assert main(argv) == 0
    for argv in rlhf_steps(tmp_path / "device"):
        proc = subprocess.run([sys.executable, "-m", "polytrain.cli", *argv], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = _step_rows(tmp_path / "cpu", "ppo"), _step_rows(tmp_path / "device", "ppo")
    assert [r["step"] for r in got] == [r["step"] for r in ref] and ref
    for a, b in zip(ref, got):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=RTOL, abs=1e-7), f"{key} at step {a['step']}"
