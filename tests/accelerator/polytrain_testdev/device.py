"""Builds device.cpp and registers it with torch: PrivateUse1 renamed "testdev", torch.testdev,
and the "testccl" collective backend. `register()` does it (the accelerator's vendor module,
polytrain_testdev.loaded, calls it). Where it cannot be built (no compiler), the import fails
and polytrain reports the accelerator unavailable with the builder's error.

The build (torch's extension builder with g++ and ninja, the toolchain polytrain's host
kernels need) takes about a minute on 2 loaded cores. It is cached in a directory keyed by
the source's bytes and torch's and Python's versions: under $POLYTRAIN_TESTDEV_BUILD, else
~/.cache/polytrain-testdev (not $POLYTRAIN_CACHE, which the test suite makes fresh per
session). Environment: POLYTRAIN_TESTDEV_DEVICES (devices per process, default 4),
POLYTRAIN_TESTDEV_GUARD=0 (device memory stays readable by the host, to debug a crash).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

NAME = "testdev"
COLLECTIVES = "testccl"
SOURCE = Path(__file__).with_name("device.cpp")
EXTENSION = "polytrain_testdev_ext"


def build_dir() -> Path:
    """Where the extension is built: one directory per source, torch and Python."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(),
                                     sys.version.encode()])).hexdigest()[:16]
    root = os.environ.get("POLYTRAIN_TESTDEV_BUILD") or Path.home() / ".cache" / "polytrain-testdev"
    return Path(root) / f"{EXTENSION}-{key}"


def _load_built(build: Path) -> ModuleType | None:
    """The finished build in `build` (~1 ms, where torch's builder spends ~0.5 s checking it),
    or None where there is none or a build is under way."""
    library = build / f"{EXTENSION}.so"
    if not library.exists() or (build / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(
        EXTENSION, library, loader=importlib.machinery.ExtensionFileLoader(EXTENSION, str(library)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _extension() -> ModuleType:
    build = build_dir()
    module = _load_built(build)
    if module is None:
        from torch.utils import cpp_extension

        build.mkdir(parents=True, exist_ok=True)
        print(f"polytrain testdev: building the test device once into {build}", file=sys.stderr, flush=True)
        module = cpp_extension.load(name=EXTENSION, sources=[str(SOURCE)], build_directory=str(build),
                                    extra_cflags=["-O1"], verbose=False)
    return module


@functools.cache
def register() -> ModuleType:
    """Build (or load) the device and register it with torch; its torch.testdev module."""
    import torch.distributed as dist

    from polytrain_testdev import module as device_module

    ext = _extension()
    ext.set_device_count(int(os.environ.get("POLYTRAIN_TESTDEV_DEVICES", "4")))
    ext.set_guard(os.environ.get("POLYTRAIN_TESTDEV_GUARD", "1") != "0")
    torch.utils.rename_privateuse1_backend(NAME)
    module = device_module.make(ext)
    torch._register_device_module(NAME, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    if dist.is_available():
        dist.Backend.register_backend(COLLECTIVES, _create_backend, extended_api=True, devices=[NAME])
    return module


def _create_backend(options, backend_options):
    """testccl for one group: device tensors staged through host copies around gloo."""
    import torch.distributed as dist

    gloo = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)
    return _extension().staging_backend(gloo, options.group_rank, options.group_size)

