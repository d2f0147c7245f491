"""The CUDA shim, installed for one test and taken out after it."""

import pytest

from polytrain.backend import CPUAccelerator
from polytrain.backend.compat import install, uninstall


@pytest.fixture
def shim(monkeypatch):
    """CUDA mapped onto the CPU, as for rank 0 of two local ranks."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    installed = install(CPUAccelerator())
    yield installed
    uninstall()
