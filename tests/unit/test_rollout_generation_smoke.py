"""benchmarks/rollout_generation.py keeps working: a tiny rollout through all five ways, whose
tokens the script requires to be equal (polytrain's continuous batching, compiled and not, and
its padded groups against transformers' generate and generate_batch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_generation.py"


def test_a_tiny_rollout_gives_the_same_tokens_every_way():
    done = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--prompts", "5", "--rows", "2",
                           "--new-tokens", "6", "--stop-every", "4", "--rounds", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| polytrain") or
            line.startswith("| transformers")]
    assert len(rows) == 5
    assert "best of each" in done.stdout
