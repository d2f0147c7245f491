"""CUDA-only private bindings (`torch._C._cuda_*`) that libraries probe once
`torch.cuda.is_available()` is True.

A CPU (or XPU, NPU, ...) build of torch has none of them, and some libraries read them at import,
before any tensor exists. The policy (docs/COMPAT.md, "Private bindings"):
1. Stand-ins, where the binding's meaning carries over (`standins`; docs/COMPAT.md lists the
   libraries that need each): the device index calls act
   on the shim's torch.cuda; the raw stream handle is the accelerator's own where it has one
   (`torch._C._xpu_getCurrentRawStream`, ...), else 0, CUDA's handle for the default stream,
   which is the only stream of a device without queues.
2. Every other `torch._C._cuda*` / `_nccl*` / `_cudnn*` name raises one line naming the binding and
   the library that asked for it. The error is an AttributeError too, so `hasattr` and
   `getattr(..., default)` probes, torch's own among them (`torch.cuda._is_compiled()`), still
   answer "not there".
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from polytrain.backend.compat.devices import DeviceMap
from polytrain.backend.compat.patcher import Patcher
from polytrain.backend.compat.standins import UnmappedAttributeError

_PREFIXES = ("_cuda", "_nccl", "_cudnn", "_cudart", "_cufft", "_cusparse", "_cublas")


def standins(dm: DeviceMap, cuda: Any) -> dict[str, Callable]:
    """The bindings with a meaning on the accelerator; `cuda` is the shim's torch.cuda."""
    own_stream = getattr(torch._C, f"_{dm.type}_getCurrentRawStream", None)

    def raw_stream(device_index: int = -1) -> int:
        return own_stream(device_index) if own_stream is not None and dm.indexed else 0

    return {
        "_cuda_getCurrentRawStream": raw_stream,
        "_cuda_setDevice": lambda index: cuda.set_device(index),
        "_cuda_getDevice": lambda: cuda.current_device(),
        "_cuda_isInBadFork": lambda: False,
    }


def install(p: Patcher, dm: DeviceMap, cuda: Any) -> None:
    """Add the stand-ins to torch._C and the one-line error for the rest."""
    for name, fn in standins(dm, cuda).items():
        if not hasattr(torch._C, name):
            p.set(torch._C, name, fn)
    target = dm.acc.name

    def missing(name: str) -> Any:
        if not name.startswith(_PREFIXES):
            raise AttributeError(f"module 'torch._C' has no attribute '{name}'")
        raise UnmappedAttributeError(
            f"torch._C.{name} is a CUDA-only binding of torch and {target} has no counterpart; "
            f"{_caller()} called it (docs/COMPAT.md, 'Private bindings', says what to do)")

    p.set(torch._C, "__getattr__", missing)


def _caller() -> str:
    """The top-level package of the first frame outside torch and this shim."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("torch", "polytrain.backend", "importlib")):
            return module.split(".")[0] if module != "__main__" else "the program"
        frame = frame.f_back
    return "torch"
