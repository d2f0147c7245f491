"""autocast("cuda") and GradScaler("cuda") on the accelerator.

torch's autocast and GradScaler are Python classes whose constructors take the device type;
their dispatch-level state (`torch.set_autocast_enabled` and friends) is not overridable, so
the shim maps the constructors' arguments (the classes themselves stay torch's, which Dynamo
recognises by identity). CUDA's autocast defaults to fp16 where the CPU's defaults to bf16, so
an unspecified dtype stays CUDA's fp16.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from polytrain.backend.compat.devices import DeviceMap
from polytrain.backend.compat.patcher import Patcher

# torch functions whose first argument is a device type ('cuda'), CUDA when left out.
AUTOCAST_STATE = ("is_autocast_enabled", "get_autocast_dtype", "set_autocast_enabled",
                  "set_autocast_dtype")


def install(p: Patcher, dm: DeviceMap) -> None:
    """Map autocast, GradScaler, custom_fwd/bwd and the autocast state queries."""
    def autocast_args(arguments: dict[str, Any]) -> None:
        if arguments.get("device_type") == "cuda":
            arguments["device_type"] = dm.type
            if arguments.get("dtype") is None:
                arguments["dtype"] = torch.float16

    p.wrap_arguments((torch.amp.autocast_mode.autocast,), "__init__", autocast_args)

    def scaler_args(arguments: dict[str, Any]) -> None:
        arguments["device"] = dm.map(arguments.get("device", "cuda"))  # the default is "cuda"

    p.wrap_arguments((torch.amp.grad_scaler.GradScaler,), "__init__", scaler_args)

    def custom_args(arguments: dict[str, Any]) -> None:
        if arguments.get("device_type") == "cuda":
            arguments["device_type"] = dm.type

    for name in ("custom_fwd", "custom_bwd"):
        p.wrap_arguments((torch.amp.autocast_mode, torch.amp), name, custom_args)
    # Functions decorated before the shim keep device_type="cuda" in a closure; the helper
    # they call to cast inputs is a module global, so map it there.
    p.wrap_arguments((torch.amp.autocast_mode,), "_cast", custom_args)
    for name in AUTOCAST_STATE:
        # With no device type these C functions answer for CUDA; answer for the accelerator.
        p.wrap(torch, name, lambda fn: _autocast_state(dm, fn))


def _autocast_state(dm: DeviceMap, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args and args[0] == "cuda":
            args = (dm.type, *args[1:])
        elif not args or not isinstance(args[0], str):
            args = (dm.type, *args)
        return fn(*args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper
