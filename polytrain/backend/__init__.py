"""Device backends. This package is the only place in polytrain that names a vendor API.

    acc = get_accelerator()          # detected (registry.py says in which order), or
                                     # POLYTRAIN_ACCELERATOR=<name>
    acc.set_device(local_rank)
    with acc.autocast(torch.bfloat16):
        loss = model(x)

Built-in: cuda (NVIDIA and AMD ROCm), xpu, npu, mlu, musa, mps, cpu. Other packages add
theirs through the `polytrain.accelerators` entry-point group (docs/PORTING.md).
"""

from __future__ import annotations

import functools
import os

from polytrain.backend.base import Accelerator, Timer
from polytrain.backend.cpu import CPUAccelerator
from polytrain.backend.cuda import CUDAAccelerator
from polytrain.backend.flops import cache_dir
from polytrain.backend.peak import Peak, datasheet_peak
from polytrain.backend.registry import ACCELERATORS, ENTRY_POINT_GROUP, accelerators
from polytrain.backend.torch_device import TorchDeviceAccelerator
from polytrain.errors import AcceleratorUnavailable, ConfigError

ENV_VAR = "POLYTRAIN_ACCELERATOR"


@functools.cache
def get_accelerator() -> Accelerator:
    """The accelerator this process trains on, chosen once and cached.

    $POLYTRAIN_ACCELERATOR=<name> forces one (unknown name: ConfigError, a ValueError; known
    but unusable here: AcceleratorUnavailable, a RuntimeError, saying why); otherwise the first
    available in detection order. Tests that change the environment call
    `get_accelerator.cache_clear()`.
    """
    known = accelerators()
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested:
        if requested not in known:
            raise ConfigError(f"{ENV_VAR}={requested!r} is not a known accelerator "
                              f"(known: {', '.join(known)})")
        cls = known[requested]
        reason = cls.unavailable_reason()
        if reason is not None:
            raise AcceleratorUnavailable(
                f"{ENV_VAR}={requested!r} but {requested} is not available in this process: "
                f"{reason} (or unset {ENV_VAR} to detect one)")
        return cls()
    return next(cls() for cls in known.values() if cls.is_available())


__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "Peak",
    "Timer",
    "TorchDeviceAccelerator",
    "accelerators",
    "cache_dir",
    "datasheet_peak",
    "get_accelerator",
]
