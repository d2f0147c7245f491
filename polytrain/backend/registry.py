"""Which accelerators exist, in the order auto-detection tries them.

Detection order (the first available wins; POLYTRAIN_ACCELERATOR=<name> skips detection):
1. plugins: accelerators other packages register under the entry-point group
   `polytrain.accelerators`, in entry-point name order. A vendor package that is installed
   wants its device used where it is present, and a plugin may replace a built-in of its name.
2. npu, mlu, musa: out-of-tree device stacks. They come before cuda because their own CUDA
   migration tools can make torch.cuda report their devices.
3. cuda (NVIDIA CUDA and AMD ROCm), xpu, mps.
4. cpu, always available.

A plugin is a class implementing `Accelerator` (usually a `TorchDeviceAccelerator` with four
attributes set), declared in the vendor package's metadata:

    [project.entry-points."polytrain.accelerators"]
    mydev = "mydev_polytrain:MyDevAccelerator"

See docs/PORTING.md.
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

from polytrain.backend.base import Accelerator
from polytrain.backend.cpu import CPUAccelerator
from polytrain.backend.cuda import CUDAAccelerator
from polytrain.backend.mlu import MLUAccelerator
from polytrain.backend.mps import MPSAccelerator
from polytrain.backend.musa import MUSAAccelerator
from polytrain.backend.npu import NPUAccelerator
from polytrain.backend.xpu import XPUAccelerator

ENTRY_POINT_GROUP = "polytrain.accelerators"

# Built-in backends in detection order (see the module docstring for why this order).
ACCELERATORS: dict[str, type[Accelerator]] = {
    cls.name: cls
    for cls in (NPUAccelerator, MLUAccelerator, MUSAAccelerator, CUDAAccelerator,
                XPUAccelerator, MPSAccelerator, CPUAccelerator)
}


def _plugin_problem(name: str, cls: object) -> str | None:
    """Why a loaded entry point is not a usable accelerator class; None if it is."""
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        return f"it is {cls!r}, not a subclass of polytrain.backend.Accelerator"
    missing = [a for a in ("name", "device_type", "dist_backend")
               if not isinstance(getattr(cls, a, None), str)]
    if missing:
        return f"it does not set {', '.join(missing)}"
    if cls.name != name:
        return f"its name is {cls.name!r} but its entry point is called {name!r}"
    return None


def plugin_accelerators() -> dict[str, type[Accelerator]]:
    """Accelerators registered by installed packages. A plugin that fails to load is skipped
    with a warning naming it, so one broken vendor install cannot stop training elsewhere."""
    found: dict[str, type[Accelerator]] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        try:
            cls = ep.load()
        except Exception as e:  # anything a third-party import raises
            problem = f"importing {ep.value} failed: {type(e).__name__}: {e}"
        else:
            problem = _plugin_problem(ep.name, cls)
        if problem:
            warnings.warn(f"polytrain: accelerator plugin {ep.name!r} skipped: {problem}", stacklevel=2)
            continue
        found[ep.name] = cls
    return found


def accelerators() -> dict[str, type[Accelerator]]:
    """Every known accelerator class by name, in detection order: plugins, then built-ins."""
    plugins = plugin_accelerators()
    return {**plugins, **{n: c for n, c in ACCELERATORS.items() if n not in plugins}}
