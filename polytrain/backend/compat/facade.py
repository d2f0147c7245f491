"""torch.cuda, served by the active accelerator.

`install` puts a facade module in place of torch.cuda: the `torch.cuda` attribute and the
sys.modules entries of torch.cuda and its loaded public submodules (amp, nvtx, memory, ...).
Each public name of the real torch.cuda resolves, in this order, to
1. a shim definition that means the same on every device: the is_available policy,
   set_device by index, amp, nvtx, lazy-init hooks, make_graphed_callables run eagerly;
2. the accelerator's device module's attribute of that name (torch.xpu.X, HostDevice.X, ...),
   with CUDA device arguments ('cuda:1', torch.device('cuda')) mapped;
3. the real object where it does not depend on the device (exception classes);
4. a stand-in (standins.py) whose use raises CompatError naming the call and why.
A name that is a type upstream resolves to a type at every step (Stream, Event, StreamContext,
device, CUDAGraph, MemPool, ...), so isinstance checks, `X | None` annotations and subclasses
work; Dynamo relies on it. Private names fall through to the real module, so torch's own
helpers keep working.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from types import ModuleType
from typing import Any, Callable

import torch

from polytrain.backend.compat.devices import DeviceMap
from polytrain.backend.compat.patcher import Patcher
from polytrain.backend.compat.standins import reason_for, standin


class CudaFacade(ModuleType):
    """A module standing in for torch.cuda or one of its submodules."""

    def __init__(self, real: ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        for attr in ("__file__", "__path__", "__spec__", "__loader__", "__package__"):
            if hasattr(real, attr):
                setattr(self, attr, getattr(real, attr))
        self.__polytrain_real__ = real

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set at install: private helpers of the real module.
        return getattr(self.__polytrain_real__, name)


# Device-independent types kept as they are: CUDA status codes.
_CONSTANTS = ("cudaStatus",)


def _map_args(dm: DeviceMap, fn: Callable) -> Callable:
    """Forward to `fn` with CUDA device names mapped (indices stay indices)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(dm.map(a, ints=False) for a in args)
        kwargs = {k: dm.map(v, ints=False) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return wrapper


def _device_overrides(dm: DeviceMap, dev: Any) -> dict[str, Any]:
    """Definitions that mean the same on every accelerator (step 1 of the module docstring)."""
    acc = dm.acc

    def set_device(device: Any) -> None:
        index = dm.index(device)
        if index is not None:
            dev.set_device(index)

    class device:  # noqa: N801 - torch.cuda.device is a lower-case class
        """Context manager that makes a device index current, like torch.cuda.device."""

        def __init__(self, device: Any) -> None:
            self.idx = dm.index(device)

        def __enter__(self) -> None:
            self.prev_idx = dev.current_device()
            if self.idx is not None and self.idx >= 0:
                dev.set_device(self.idx)

        def __exit__(self, *exc: object) -> None:
            dev.set_device(self.prev_idx)

    class device_of(device):  # noqa: N801
        """The device of a tensor made current; a no-op for tensors off the accelerator."""

        def __init__(self, obj: torch.Tensor) -> None:
            super().__init__(obj.get_device() if obj.device.type == dm.type and dm.indexed else -1)

    overrides = {"device": device, "device_of": device_of}
    if not isinstance(getattr(dev, "StreamContext", None), type):
        class StreamContext:
            """Context manager that makes a stream current, like torch.cuda.StreamContext."""

            def __init__(self, stream: Any) -> None:
                self.stream = stream

            def __enter__(self) -> None:
                self.prev = dev.current_stream()
                if self.stream is not None:
                    dev.set_stream(self.stream)

            def __exit__(self, *exc: object) -> None:
                if self.stream is not None:
                    dev.set_stream(self.prev)

        overrides.update(StreamContext=StreamContext, stream=StreamContext)

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        # Only a (major, minor) pair is a CUDA capability; anything else (torch.xpu answers
        # with a dict) reads as (0, 0), "no CUDA architecture", so CUDA-only kernels are skipped.
        own = getattr(dev, "get_device_capability", None)
        value = own(dm.index(device)) if own else None
        return value if isinstance(value, tuple) and len(value) == 2 else (0, 0)

    return {
        # The is_available policy (docs/COMPAT.md): torch.cuda *is* the accelerator, so it
        # answers whether the accelerator is usable; always True on the CPU.
        "is_available": dev.is_available,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "_initialized": True,
        "_lazy_init": lambda: None,
        # CUDA queues these until the driver initialises; the accelerator is ready now.
        "_lazy_call": lambda callable, **kwargs: callable(),
        "_is_in_bad_fork": lambda: False,
        "_get_device_index": lambda device, optional=False, allow_cpu=False: (
            dev.current_device() if dm.index(device) is None else dm.index(device)),
        "set_device": set_device,
        **overrides,
        "get_device_capability": get_device_capability,
        "is_bf16_supported": lambda including_emulation=True: (
            torch.bfloat16 in acc.autocast_dtypes()),
        "is_current_stream_capturing": lambda: False,
        # Graphs only speed up replay; running the callables eagerly computes the same.
        "make_graphed_callables": lambda callables, *args, **kwargs: callables,
    }


def _amp(dm: DeviceMap) -> dict[str, Any]:
    """torch.cuda.amp's names on the accelerator (fp16 by default, as CUDA's)."""
    base_autocast, base_scaler = torch.amp.autocast_mode.autocast, torch.amp.GradScaler

    class autocast(base_autocast):  # noqa: N801
        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> None:
            super().__init__(dm.type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    class GradScaler(base_scaler):
        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000,
                     enabled: bool = True) -> None:
            super().__init__(dm.type, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             enabled=enabled)

    def custom_fwd(fwd: Callable | None = None, *, cast_inputs: torch.dtype | None = None) -> Any:
        return torch.amp.custom_fwd(fwd, device_type=dm.type, cast_inputs=cast_inputs)

    def custom_bwd(bwd: Callable | None = None) -> Any:
        return torch.amp.custom_bwd(bwd, device_type=dm.type)

    return {"autocast": autocast, "GradScaler": GradScaler, "custom_fwd": custom_fwd,
            "custom_bwd": custom_bwd, "amp_definitely_not_available": lambda: False}


def _nvtx() -> dict[str, Any]:
    """NVTX ranges become torch profiler ranges (record_function), which every device's
    profiler shows; with no profiler running they cost next to nothing."""
    local = threading.local()

    def stack() -> list:
        if not hasattr(local, "ranges"):
            local.ranges = []
        return local.ranges

    def range_push(msg: str) -> int:
        ranges = stack()
        ranges.append(torch.autograd.profiler.record_function(msg))
        ranges[-1].__enter__()
        return len(ranges) - 1

    def range_pop() -> int:
        ranges = stack()
        if not ranges:
            return -1
        ranges.pop().__exit__(None, None, None)
        return len(ranges)

    started: dict[int, Any] = {}

    def range_start(msg: str) -> int:
        handle = torch.autograd.profiler.record_function(msg)
        handle.__enter__()
        started[id(handle)] = handle
        return id(handle)

    def range_end(range_id: int) -> None:
        started.pop(range_id).__exit__(None, None, None)

    @contextlib.contextmanager
    def range(msg: str, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - nvtx's name
        with torch.autograd.profiler.record_function(msg.format(*args, **kwargs)):
            yield

    def mark(msg: str) -> None:
        with torch.autograd.profiler.record_function(msg):
            pass

    return {"range_push": range_push, "range_pop": range_pop, "range_start": range_start,
            "range_end": range_end, "range": range, "mark": mark}


def _profiler() -> dict[str, Any]:
    """cudaProfilerStart/Stop bracket a region for nsys; other devices' profilers attach
    their own way, so these mark nothing and fail nothing."""
    return {"start": lambda: None, "stop": lambda: None, "init": lambda *a, **k: None,
            "profile": contextlib.nullcontext}


def _public_names(module: ModuleType) -> set[str]:
    """What a module offers: __all__, the functions and classes it defines (some modules leave
    them out of __all__), its exception classes and its public submodules."""
    names = set(getattr(module, "__all__", ()))
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if getattr(value, "__module__", None) == module.__name__ and callable(value):
            names.add(name)
        elif isinstance(value, ModuleType) and value.__name__.startswith("torch.cuda."):
            names.add(name)
        elif isinstance(value, type) and issubclass(value, BaseException):
            names.add(name)
    return names


def _facaded_modules() -> list[str]:
    """torch.cuda and its loaded public submodules, parents before children."""
    names = [n for n, m in list(sys.modules.items())
             if m is not None and (n == "torch.cuda" or n.startswith("torch.cuda."))
             and not any(part.startswith("_") for part in n.split("."))]
    return sorted(names, key=lambda n: n.count("."))


def install(p: Patcher, dm: DeviceMap) -> CudaFacade:
    """Build the facades, put them in place of the real modules, and return torch.cuda's."""
    dev = dm.acc.device_module()
    target = dm.acc.name
    host_tensor_types = dm.type == "cpu"  # torch.FloatTensor etc. are the host's types
    amp = _amp(dm)
    definitions = {"": _device_overrides(dm, dev), "amp": amp, "amp.common": amp,
                   "nvtx": _nvtx(), "profiler": _profiler()}
    private = {**{n: "" for n in definitions[""] if n.startswith("_")},
               **{n: "memory" for n in ("_record_memory_history", "_snapshot", "_dump_snapshot")}}
    mapped: dict[int, Any] = {}  # id(real object) -> its replacement, across all facades

    def resolve(module: ModuleType, suffix: str, name: str, value: Any) -> Any:
        own = definitions.get(suffix, {})
        if name in own:
            return own[name]
        if suffix and id(value) in mapped:  # e.g. torch.cuda.memory.memory_allocated
            return mapped[id(value)]
        if isinstance(value, type) and (issubclass(value, BaseException) or name in _CONSTANTS):
            return value
        forwarded = getattr(dev, name, None) if not suffix else None
        if forwarded is not None and isinstance(forwarded, type) == isinstance(value, type):
            if callable(forwarded) and not isinstance(forwarded, type):
                return _map_args(dm, forwarded)
            return forwarded
        if host_tensor_types and name.endswith(("Tensor", "Storage")):
            legacy = torch.sparse if suffix == "sparse" else torch
            if isinstance(getattr(legacy, name, None), type):
                return getattr(legacy, name)
        return standin(f"{module.__name__}.{name}", target, reason_for(name, suffix, target), value)

    facades: dict[str, CudaFacade] = {}
    for module_name in _facaded_modules():
        module = sys.modules[module_name]
        suffix = module_name[len("torch.cuda."):] if module_name != "torch.cuda" else ""
        facade = facades[module_name] = CudaFacade(module)
        names = _public_names(module) | {n for n, where in private.items() if where == suffix}
        for name in sorted(names):
            value = getattr(module, name, None)
            if isinstance(value, ModuleType):
                continue  # linked below, once every facade exists
            new = resolve(module, suffix, name, value)
            setattr(facade, name, new)
            if value is not None and value is not new and not isinstance(value, (int, str)):
                mapped[id(value)] = new
                p.note_replacement(value, new)
    for module_name, facade in facades.items():
        parent, _, child = module_name.rpartition(".")
        if parent in facades:
            setattr(facades[parent], child, facade)
        p.note_replacement(facade.__polytrain_real__, facade)
        p.set_module(module_name, facade)
    p.set(torch, "cuda", facades["torch.cuda"])
    return facades["torch.cuda"]
