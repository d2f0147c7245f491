"""Where CUDA code names a device, name the active accelerator's instead.

`DeviceMap` translates one designation: 'cuda', 'cuda:N', torch.device('cuda', N) and the
integer indices `torch.cuda.current_device()` returns and Megatron passes. mode.py applies it to
every torch call (factories, `.to()`, `.cuda()`, `.new_*()`); this module to what does not go
through torch's dispatch: `with torch.device("cuda")`, checkpoints loaded with or without
`map_location`, and DataLoader's pinning. A tensor's own device is never disguised:
`x.device.type` and `x.is_cuda` tell the truth, because torch's own Python code branches on
them to pick CUDA-only kernels (docs/COMPAT.md).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.utils._device  # `with torch.device(...)` support; loaded on first use otherwise

from polytrain.backend.base import Accelerator
from polytrain.backend.compat.patcher import Patcher

_CUDA_DEVICE = re.compile(r"^cuda(?::(\d+))?$")


class DeviceMap:
    """Translates CUDA device designations into the accelerator's."""

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc
        self.type = acc.device_type
        # Whether devices are told apart by index (xpu:0, xpu:1); the CPU and MPS are one device.
        self.indexed = acc.device(1) != acc.device(0)

    def device(self, index: int | None) -> torch.device:
        """The accelerator's device for CUDA index `index` (None: the current one)."""
        return torch.device(self.type) if index is None else self.acc.device(index)

    def map(self, value: Any, ints: bool = True) -> Any:
        """'cuda', 'cuda:N', torch.device('cuda', N) and (where `ints`) a bare index N -> the
        accelerator's device, of the same kind (str stays str); anything else unchanged."""
        if isinstance(value, torch.device):
            return self.device(value.index) if value.type == "cuda" else value
        if isinstance(value, str):  # no regex here: Dynamo traces this (mode.py)
            if value == "cuda":
                return str(self.device(None))
            if value.startswith("cuda:") and value[5:].isdigit():
                return str(self.device(int(value[5:])))
            return value
        if ints and isinstance(value, int) and not isinstance(value, bool):
            return self.device(value)
        return value

    def index(self, value: Any) -> int | None:
        """The CUDA index `value` names (int, 'cuda:N', torch.device); None if it names none."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            match = _CUDA_DEVICE.match(value)
            if match is not None:
                return int(match[1]) if match[1] else None
            value = torch.device(value)
        if isinstance(value, torch.device):
            return value.index
        return None

    def restore(self, storage: Any, location: str) -> Any:
        """torch.serialization deserializer: a storage saved on (or mapped to) a CUDA device
        lands on the accelerator; None leaves every other location to torch."""
        if _CUDA_DEVICE.match(location):
            return storage.to(device=self.map(location))
        return None


# Ahead of torch's own deserializers (cpu 10, cuda 20, ...), which raise for 'cuda' off CUDA.
_RESTORE_PRIORITY = 1


def install(p: Patcher, dm: DeviceMap) -> None:
    """What CUDA code names a device with outside torch's dispatch (module docstring)."""
    # `with torch.device("cuda"):` and torch.set_default_device("cuda") build a DeviceContext,
    # which fills device= into factories; give it the accelerator's device instead.
    def context_args(arguments: dict[str, Any]) -> None:
        arguments["device"] = dm.map(arguments["device"])

    p.wrap_arguments((torch.utils._device.DeviceContext,), "__init__", context_args)
    # torch.load: with no map_location, or one that names a CUDA device ('cuda:1',
    # torch.device('cuda'), {'cuda:0': 'cuda:1'}), torch asks its deserializers in turn.
    registry = torch.serialization._package_registry
    entry = (_RESTORE_PRIORITY, lambda storage: None, dm.restore)
    registry.insert(0, entry)
    p.on_undo(lambda: registry.remove(entry))
    _install_loader_pinning(p, dm, dm.acc)


def _install_loader_pinning(p: Patcher, dm: DeviceMap, acc: Accelerator) -> None:
    """Where the accelerator cannot page-lock host memory (the CPU, Apple's unified memory),
    pinning is a no-op, as DeepSpeed's CPU accelerator makes it: pinned memory only exists to
    speed copies to a device, and there is no copy. (Tensor.pin_memory: mode.py.)"""
    loader = torch.utils.data.DataLoader

    def loader_args(arguments: dict[str, Any]) -> None:
        if not acc.pin_memory_available():
            arguments["pin_memory"] = False  # instead of torch's "no accelerator" warning
        if arguments.get("pin_memory_device"):
            arguments["pin_memory_device"] = dm.type
    p.wrap_arguments((loader,), "__init__", loader_args)
