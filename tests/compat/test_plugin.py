"""A vendor adds a backend by installing a package: pip installs tests/compat/plugin_pkg and
polytrain detects, selects and serves CUDA code on its accelerator without being changed."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.backend import CPUAccelerator, registry

PROGRAMS = Path(__file__).parent / "programs"
PROBE = """
import json, sys
from polytrain.backend import accelerators, get_accelerator
from polytrain.errors import PolytrainError
try:
    chosen = get_accelerator().name
except PolytrainError as e:
    chosen = f"error: {e}"
print(json.dumps({"known": list(accelerators()), "chosen": chosen}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The plugin, pip-installed into a directory of its own (the test environment is left
    as it was); subprocesses find it on PYTHONPATH, as they would in site-packages."""
    work = tmp_path_factory.mktemp("plugin")
    shutil.copytree(Path(__file__).parent / "plugin_pkg", work / "src")  # builds write there
    # Without build isolation pip needs no index, where setuptools is already installed.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation,
                    "--target", str(work / "site"), str(work / "src")], check=True, timeout=300)
    assert list((work / "site").glob("polytrain_demo_accelerator-*.dist-info/entry_points.txt"))
    return work / "site"


def run(site: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("POLYTRAIN_ACCELERATOR", "POLYTRAIN_DEMO_DEVICE")}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env={**environ, **env}, timeout=300)


def test_installed_plugin_is_listed_first_and_detected(site):
    present = json.loads(run(site, ["-c", PROBE], POLYTRAIN_DEMO_DEVICE="1").stdout)
    assert present["known"][0] == "demo" and present["known"][-1] == "cpu"
    assert present["chosen"] == "demo"
    absent = json.loads(run(site, ["-c", PROBE]).stdout)
    assert "demo" in absent["known"] and absent["chosen"] == "cpu"
    asked = json.loads(run(site, ["-c", PROBE], POLYTRAIN_ACCELERATOR="demo").stdout)
    assert asked["chosen"] == ("error: POLYTRAIN_ACCELERATOR='demo' but demo is not available in "
                               "this process: no demo device (POLYTRAIN_DEMO_DEVICE is not 1) "
                               "(or unset POLYTRAIN_ACCELERATOR to detect one)")


def test_cuda_code_runs_on_the_plugins_accelerator(site):
    proc = run(site, ["-m", "polytrain.cli", "run", str(PROGRAMS / "cuda_basics.py")],
               POLYTRAIN_DEMO_DEVICE="1")
    assert proc.returncode == 0, proc.stderr
    assert "torch.cuda -> demo (cpu), nccl -> gloo" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["available"] is True


def test_broken_plugins_are_skipped_with_a_warning_naming_them(tmp_path, monkeypatch):
    """Entry points as an installed distribution declares them, in its dist-info."""
    info = tmp_path / "vendor_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vendor-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[polytrain.accelerators]\n"
        "missing = no_such_vendor_module:Accelerator\n"
        "notaclass = json:dumps\n"
        "misnamed = polytrain.backend:CPUAccelerator\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning) as caught:
        found = registry.plugin_accelerators()
    assert found == {}
    messages = sorted(str(w.message) for w in caught)
    assert "'misnamed' skipped: its name is 'cpu' but its entry point is called 'misnamed'" in messages[0]
    assert "'missing' skipped: importing no_such_vendor_module:Accelerator failed: ModuleNotFoundError" in messages[1]
    assert "'notaclass' skipped: it is <function dumps" in messages[2]
    assert list(registry.accelerators())[-1] == "cpu" and registry.ACCELERATORS["cpu"] is CPUAccelerator
