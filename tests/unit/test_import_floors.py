"""The import floors of pyproject.toml's import-linter contracts hold, and catch an upward import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """Run the project's contracts over the `polytrain` package found in `package_parent`."""
    linter = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(linter), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          capture_output=True, text=True, cwd=package_parent, env=env, timeout=300)


def test_the_package_keeps_its_import_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_an_upward_import_breaks_the_floors_and_is_named(tmp_path):
    shutil.copytree(ROOT / "polytrain", tmp_path / "polytrain", ignore=shutil.ignore_patterns("__pycache__"))
    base = tmp_path / "polytrain" / "models" / "common" / "base.py"
    base.write_text(base.read_text() + "\n\ndef _upward():\n    from polytrain.train import trainer  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "Floors run one way: lower packages never import higher ones BROKEN" in result.stdout
    assert "polytrain.models.common.base -> polytrain.train.trainer" in result.stdout
