"""The CUDA shim: code written for CUDA runs unchanged on the active accelerator.

    from polytrain.backend.compat import install
    install()                      # now torch.cuda, device="cuda", "nccl", ... mean the accelerator

Users reach it through `polytrain run SCRIPT`, `python -m polytrain.compat SCRIPT` or
`import polytrain.compat.auto`; docs/COMPAT.md says what is mapped and what is not.

torch's own functions stay torch's: devices named in torch calls are mapped by a
TorchFunctionMode (mode.py), so torch.compile, TorchScript and FX see the real functions, and
every torch.cuda name that is a class upstream stays a class (facade.py, standins.py).

The one policy everything follows: under the shim, torch.cuda *is* the active accelerator.
`torch.cuda.is_available()` answers whether the accelerator is usable (always True on the CPU),
`device_count()` how many devices it has (the CPU counts one per local rank), and every other
name acts on the accelerator or, where it has no counterpart, raises CompatError naming the
call. CUDA scripts that check is_available() before using the GPU, or assert it as Megatron
does, therefore run on the accelerator. Frameworks that choose their own device support by
probing torch.cuda (DeepSpeed) are pointed at their native support for the accelerator through
their documented override, so they do not take their CUDA path through the shim.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from polytrain.backend import get_accelerator
from polytrain.backend.base import Accelerator
from polytrain.backend.compat import amp, bindings, devices, dist, extensions, facade, mode
from polytrain.backend.compat.patcher import Patcher
from polytrain.errors import CompatError

log = logging.getLogger(__name__)

# DeepSpeed's own accelerator names (accelerator/real_accelerator.py); it reads DS_ACCELERATOR
# when it first asks for its accelerator.
_DEEPSPEED_ACCELERATORS = {"cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa"}


@dataclass
class Shim:
    """An installed shim: the accelerator it serves and how to take it out again."""

    accelerator: Accelerator
    patcher: Patcher
    rebound: int = 0
    environ_set: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for logs."""
        acc = self.accelerator
        return (f"polytrain compat: torch.cuda -> {acc.name} ({acc.device_type}), "
                f"nccl -> {acc.dist_backend}")


_active: Shim | None = None


def active() -> Shim | None:
    """The installed shim, or None."""
    return _active


def install(accelerator: Accelerator | None = None) -> Shim | None:
    """Map CUDA onto `accelerator` (default: the detected one) in this process; idempotent.

    Returns the shim, or None when the accelerator is CUDA itself: CUDA code runs natively and
    there is nothing to map. Install before the program imports the code it runs, so that
    `from torch.cuda import X` gets the mapped X; names imported earlier are rebound where
    they are module globals.
    """
    global _active
    if _active is not None:
        return _active
    acc = accelerator or get_accelerator()
    if acc.device_type == "cuda":
        log.info("polytrain compat: running on CUDA itself, nothing to map")
        return None
    patcher = Patcher()
    try:
        dm = devices.DeviceMap(acc)
        cuda = facade.install(patcher, dm)
        devices.install(patcher, dm)
        amp.install(patcher, dm)
        bindings.install(patcher, dm, cuda)
        dist.install(patcher, dm)
        extensions.install(patcher, acc.name)
        shim = Shim(acc, patcher)
        shim.rebound = patcher.rebind_imported_names()
        mode.install(patcher, dm)  # last: nothing above may run torch calls under it half-built
    except BaseException:
        patcher.undo()  # never leave torch half-patched
        raise
    if acc.device_type in _DEEPSPEED_ACCELERATORS and "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = acc.device_type
        shim.environ_set.append("DS_ACCELERATOR")
    _active = shim
    log.info(shim.describe())
    return shim


def uninstall() -> None:
    """Restore torch as it was before `install` (tests use this; programs need not)."""
    global _active
    if _active is None:
        return
    _active.patcher.undo()
    for name in _active.environ_set:
        os.environ.pop(name, None)
    _active = None


__all__ = ["CompatError", "Shim", "active", "install", "uninstall"]
