"""CUDA device names reach the accelerator through a TorchFunctionMode, not through wrappers.

torch hands every call of an overridable function (factories, Tensor methods, torch.nn.functional)
to the active TorchFunctionModes before it dispatches. `CudaDeviceMode` rewrites the device the
call names, `device="cuda"`, `"cuda:1"`, `torch.device("cuda", 1)` or a bare index, into the
accelerator's, then calls the very function torch passed in. torch's functions themselves stay
in place, so `torch.jit.script` finds its builtins, `inspect` and FX see torch's signatures, and
Dynamo traces through the mode like any other (torch.compile puts the mapped device into the
graph; the compiled code never calls the mode again).

The mode is pushed once per thread: at install for the thread that installs it, and by
`enter_in_new_threads` for each thread started afterwards (torch's mode stack is thread-local).
The autograd engine runs Python callbacks (custom Functions' backward, gradient hooks) with an
empty mode stack, so `enter_in_backward` puts the mode back for them: DeepSpeed's gradient
hooks and Megatron's backward passes allocate on "cuda" too.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from polytrain.backend.compat.devices import DeviceMap
from polytrain.backend.compat.patcher import Patcher

_Tensor = torch.Tensor


class CudaDeviceMode(TorchFunctionMode):
    """Maps CUDA devices named in torch calls onto the accelerator (see the module docstring)."""

    def __init__(self, dm: DeviceMap) -> None:
        super().__init__()
        self.dm = dm
        pin = dm.acc.pin_memory_available()
        legacy = "torch." if dm.type == "cpu" else f"torch.{dm.type}."  # torch.FloatTensor's module
        # Calls that take a device positionally or mean something else off CUDA, by function.
        self.special: dict[Callable, Callable] = {
            _Tensor.to: self._to,
            _Tensor.cuda: self._cuda,
            _Tensor.type: functools.partial(_legacy_type, legacy=legacy, accelerator=dm.type),
            _Tensor.record_stream: _record_stream,
            _Tensor.pin_memory: self._map_kwargs if pin else lambda func, args, kwargs: args[0],
            _Tensor.is_pinned: self._map_kwargs if pin else lambda func, args, kwargs: False,
        }

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        # The common case first and cheapest: an op that names no device (x + y, x.view(...)).
        handler = self.special.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        if not kwargs:
            return func(*args)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": self.dm.map(kwargs["device"])}
        return func(*args, **kwargs)

    def _map_kwargs(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if "device" in kwargs:
            kwargs = {**kwargs, "device": self.dm.map(kwargs["device"])}
        return func(*args, **kwargs)

    def _to(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        # Tensor.to(device, dtype, ...), .to(dtype), .to(other), .to(device=...).
        if len(args) > 1 and isinstance(args[1], (str, int, torch.device)) \
                and not isinstance(args[1], bool):
            args = (args[0], self.dm.map(args[1]), *args[2:])
        return self._map_kwargs(func, args, kwargs)

    def _cuda(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        # Tensor.cuda(device=None, non_blocking=False, memory_format=torch.preserve_format)
        tensor, rest = args[0], dict(zip(("device", "non_blocking", "memory_format"), args[1:]))
        rest.update(kwargs)
        device = rest.pop("device", None)
        target = self.dm.device(None) if device is None else self.dm.map(device)
        return _Tensor.to(tensor, target, **rest)


def _legacy_type(func: Callable, args: tuple, kwargs: dict, legacy: str, accelerator: str) -> Any:
    """Tensor.type() in CUDA's legacy names, both ways.

    x.type("torch.cuda.HalfTensor") casts to the accelerator's legacy type; x.type() of a tensor
    on the accelerator answers "torch.cuda.HalfTensor", since CUDA code compares that string
    (Megatron's mixed-precision optimizers sort their bf16 / fp16 / fp32 parameters by it).
    """
    if len(args) > 1 and isinstance(args[1], str) and args[1].startswith("torch.cuda."):
        args = (args[0], legacy + args[1][len("torch.cuda."):], *args[2:])
    name = func(*args, **kwargs)
    if isinstance(name, str) and args[0].device.type == accelerator and name.startswith(legacy):
        return "torch.cuda." + name[len(legacy):]  # "torch.BFloat16Tensor" -> "torch.cuda.BFloat16Tensor"
    return name


def _record_stream(func: Callable, args: tuple, kwargs: dict) -> Any:
    # A stream of the host (HostStream) orders nothing: the host frees memory in program order.
    stream = args[1] if len(args) > 1 else kwargs.get("stream")
    if stream.device.type == "cpu":
        return None
    return func(*args, **kwargs)


def install(p: Patcher, dm: DeviceMap) -> CudaDeviceMode:
    """Push the mode for this thread and for every thread started from now on."""
    mode = CudaDeviceMode(dm)
    torch._C._push_on_torch_function_stack(mode)
    p.on_undo(lambda: _remove(mode))
    enter_in_new_threads(p, mode)
    enter_in_backward(p, mode)
    return mode


def enter_in_backward(p: Patcher, mode: CudaDeviceMode) -> None:
    """Run what the autograd engine calls back into Python with the mode on the stack."""
    def entered(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
                return fn(*args, **kwargs)
            torch._C._push_on_torch_function_stack(mode)
            try:
                return fn(*args, **kwargs)
            finally:
                _remove(mode)
        return run

    # Every custom autograd.Function's backward goes through BackwardCFunction.apply.
    p.wrap(torch.autograd.function.BackwardCFunction, "apply", entered)
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        def register(original: Callable) -> Callable:
            @functools.wraps(original)
            def wrapper(self: torch.Tensor, hook: Callable) -> Any:
                return original(self, entered(hook))
            return wrapper
        p.wrap(_Tensor, name, register)


def enter_in_new_threads(p: Patcher, mode: CudaDeviceMode) -> None:
    """Threads start with an empty mode stack: push the mode before each one's run()."""
    def bootstrap(original: Callable) -> Callable:
        def wrapper(self: threading.Thread) -> None:
            torch._C._push_on_torch_function_stack(mode)
            original(self)
        return wrapper

    # _bootstrap_inner calls run() in the new thread, also for subclasses that override run.
    p.wrap(threading.Thread, "_bootstrap_inner", bootstrap)


def _remove(mode: CudaDeviceMode) -> None:
    """Take `mode` off this thread's stack, keeping any modes above it."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
