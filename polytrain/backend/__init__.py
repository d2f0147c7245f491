"""Device backends. This package is the only place in polytrain that names a vendor API.

    acc = get_accelerator()          # cuda if available, else cpu; POLYTRAIN_ACCELERATOR overrides
    acc.set_device(local_rank)
    with acc.autocast(torch.bfloat16):
        loss = model(x)
"""

from __future__ import annotations

import functools
import os

from polytrain.backend.base import Accelerator, Timer
from polytrain.backend.cpu import CPUAccelerator
from polytrain.backend.cuda import CUDAAccelerator
from polytrain.backend.flops import cache_dir, gpu_peak_flops

# Name -> class, in auto-detection priority: the first available one wins, so the CPU,
# always available, comes last. New backends add themselves here.
ACCELERATORS: dict[str, type[Accelerator]] = {
    "cuda": CUDAAccelerator,
    "cpu": CPUAccelerator,
}

ENV_VAR = "POLYTRAIN_ACCELERATOR"


@functools.cache
def get_accelerator() -> Accelerator:
    """The accelerator this process trains on, chosen once and cached.

    $POLYTRAIN_ACCELERATOR=<name> forces one (unknown name: ValueError; known but unusable
    here: RuntimeError); otherwise the first available in ACCELERATORS order.
    Tests that change the environment call `get_accelerator.cache_clear()`.
    """
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested:
        if requested not in ACCELERATORS:
            known = ", ".join(ACCELERATORS)
            raise ValueError(f"{ENV_VAR}={requested!r} is not a known accelerator (known: {known})")
        cls = ACCELERATORS[requested]
        if not cls.is_available():
            raise RuntimeError(
                f"{ENV_VAR}={requested!r} but {requested} is not available in this process "
                f"(check the driver, the torch build and visible devices, or unset {ENV_VAR})"
            )
        return cls()
    return next(cls() for cls in ACCELERATORS.values() if cls.is_available())


__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "ENV_VAR",
    "Timer",
    "cache_dir",
    "gpu_peak_flops",
    "get_accelerator",
]
