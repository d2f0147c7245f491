"""Where CUDA code names a device, name the active accelerator's instead.

Covers `device=` in torch's factories, `.to()`, `.cuda()` and `.new_*()` on tensors and modules,
integer device indices (what `torch.cuda.current_device()` returns and Megatron passes),
`map_location`, pinned memory, autocast and GradScaler. A tensor's own device is never
disguised: `x.device.type` and `x.is_cuda` tell the truth, because torch's own Python code
branches on them to pick CUDA-only kernels (docs/COMPAT.md).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.utils._device  # `with torch.device(...)` support; loaded on first use otherwise

from polytrain.backend.base import Accelerator
from polytrain.backend.compat.patcher import Patcher

_CUDA_DEVICE = re.compile(r"^cuda(?::(\d+))?$")

# torch functions that create tensors and take `device=`.
FACTORIES = (
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "rand", "randn",
    "randint", "randperm", "arange", "range", "linspace", "logspace", "eye", "zeros_like",
    "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "empty_strided", "empty_permuted", "tril_indices", "triu_indices", "scalar_tensor",
    "sparse_coo_tensor", "normal", "from_file", "hann_window", "hamming_window",
    "blackman_window", "bartlett_window", "kaiser_window",
)
TENSOR_NEW = ("new_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")
# torch functions whose first argument is a device type string ('cuda').
AUTOCAST_STATE = ("is_autocast_enabled", "get_autocast_dtype", "set_autocast_enabled",
                  "set_autocast_dtype")


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
        if isinstance(value, str):
            match = _CUDA_DEVICE.match(value)
            if match is None:
                return value
            return str(self.device(int(match[1]) if match[1] else None))
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

    def map_location(self, location: Any) -> Any:
        """torch.load's map_location: strings, devices, ints and dict values are mapped; with
        no map_location, tensors saved on a CUDA device load onto the accelerator."""
        if location is None:
            return self._restore
        if isinstance(location, dict):
            return {k: self.map(v) for k, v in location.items()}
        return location if callable(location) else self.map(location)

    def _restore(self, storage: Any, location: str) -> Any:
        if _CUDA_DEVICE.match(location):
            return storage.to(device=self.map(location))
        return None  # torch's default placement for everything else


def _map_kwarg(dm: DeviceMap, fn: Callable, key: str = "device") -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if key in kwargs:
            kwargs[key] = dm.map(kwargs[key])
        return fn(*args, **kwargs)

    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    return wrapper


def _map_to(dm: DeviceMap, to: Callable) -> Callable:
    """Tensor.to / Module.to: the device may come first, positionally, or as device=."""
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], (str, int, torch.device)) and not isinstance(args[0], bool):
            args = (dm.map(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = dm.map(kwargs["device"])
        return to(self, *args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = to.__name__, to.__doc__
    return wrapper


def _first_arg(dm: DeviceMap, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (dm.map(args[0]), *args[1:])
        return fn(*args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


def install(p: Patcher, dm: DeviceMap) -> None:
    """Patch torch so CUDA device names reach the accelerator."""
    acc = dm.acc
    # `with torch.device(d):` fills in device=d for the factories in this cached set, matched
    # by identity with the function torch dispatches, which stays the original under our
    # wrapper: fill the cache with the originals before wrapping them, or `with
    # torch.device("meta")` would silently build on the host instead.
    torch.utils._device._device_constructors()
    p.wrap_arguments((torch.utils._device.DeviceContext,), "__init__", _map_device_argument(dm))
    for name in FACTORIES:
        if hasattr(torch, name):
            p.wrap(torch, name, lambda fn: _map_kwarg(dm, fn))
    p.wrap(torch, "set_default_device", lambda fn: _first_arg(dm, fn))
    p.wrap(torch, "load", lambda fn: _load(dm, fn))

    tensor, module = torch.Tensor, torch.nn.Module
    for name in TENSOR_NEW:
        p.wrap(tensor, name, lambda fn: _map_kwarg(dm, fn))
    p.wrap(tensor, "to", lambda fn: _map_to(dm, fn))
    p.wrap(module, "to", lambda fn: _map_to(dm, fn))
    p.wrap(module, "to_empty", lambda fn: _map_kwarg(dm, fn))
    p.set(tensor, "cuda", _tensor_cuda(dm))
    p.set(module, "cuda", lambda self, device=None: self.to(dm.map(device) if device is not None
                                                            else dm.device(None)))
    _install_pinning(p, dm, acc)
    _install_amp(p, dm)


def _map_device_argument(dm: DeviceMap) -> Callable[[dict[str, Any]], None]:
    def transform(arguments: dict[str, Any]) -> None:
        arguments["device"] = dm.map(arguments["device"])
    return transform


def _load(dm: DeviceMap, load: Callable) -> Callable:
    def wrapper(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        return load(f, dm.map_location(map_location), *args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = load.__name__, load.__doc__
    return wrapper


def _tensor_cuda(dm: DeviceMap) -> Callable:
    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
             memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        target = dm.device(None) if device is None else dm.map(device)
        return self.to(target, non_blocking=non_blocking, memory_format=memory_format)

    return cuda


def _install_pinning(p: Patcher, dm: DeviceMap, acc: Accelerator) -> None:
    """Where the accelerator cannot page-lock host memory (the CPU, Apple's unified memory),
    pinning is a no-op, as DeepSpeed's CPU accelerator makes it: pinned memory only exists to
    speed copies to a device, and there is no copy."""
    tensor = torch.Tensor
    if acc.pin_memory_available():
        p.wrap(tensor, "pin_memory", lambda fn: _map_kwarg(dm, fn))
        p.wrap(tensor, "is_pinned", lambda fn: _map_kwarg(dm, fn))
    else:
        p.set(tensor, "pin_memory", lambda self, device=None: self)
        p.set(tensor, "is_pinned", lambda self, device=None: False)

    def record_stream(original: Callable) -> Callable:
        def wrapper(self: torch.Tensor, stream: Any) -> None:
            if isinstance(stream, torch.Stream):
                original(self, stream)
            # else: a host stream of the shim; the host frees memory in order anyway
        return wrapper

    p.wrap(tensor, "record_stream", record_stream)

    loader = torch.utils.data.DataLoader

    def loader_args(arguments: dict[str, Any]) -> None:
        if not acc.pin_memory_available():
            arguments["pin_memory"] = False  # instead of torch's "no accelerator" warning
        if arguments.get("pin_memory_device"):
            arguments["pin_memory_device"] = dm.type
    p.wrap_arguments((loader,), "__init__", loader_args)


def _install_amp(p: Patcher, dm: DeviceMap) -> None:
    """autocast('cuda') and GradScaler('cuda') on the accelerator. CUDA's autocast defaults to
    fp16 where the CPU's defaults to bf16, so an unspecified dtype stays CUDA's fp16."""
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
