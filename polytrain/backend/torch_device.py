"""Devices torch drives through a `torch.<type>` module shaped like torch.cuda.

torch.xpu (in torch), torch.npu (torch_npu), torch.mlu (torch_mlu) and torch.musa (torch_musa)
all copy torch.cuda's function names: set_device, synchronize, Event, memory_allocated,
manual_seed, get_rng_state, ... So one class implements the Accelerator interface for all of
them, and a backend for such a device is a subclass that sets four attributes:

    class NPUAccelerator(TorchDeviceAccelerator):
        name, device_type, dist_backend, vendor_module = "npu", "npu", "hccl", "torch_npu"

The vendor package is imported on first use (detection or training), never at polytrain import,
so a machine without it pays nothing and a broken install only disables that backend.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from polytrain.backend.base import Accelerator, Timer

_GIB = 2**30


class EventTimer(Timer):
    """Times a `with` block with device events, so queued kernels count even though the
    host leaves the block before they finish; reading `elapsed_s` waits for them."""

    def __init__(self, module: ModuleType) -> None:
        self._start_event = module.Event(enable_timing=True)
        self._end_event = module.Event(enable_timing=True)
        self._recorded = False

    def __enter__(self) -> EventTimer:
        self._start_event.record()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_event.record()
        self._recorded = True

    @property
    def elapsed_s(self) -> float:
        """Device seconds between entering and leaving the block (synchronizes on the end)."""
        if not self._recorded:
            raise RuntimeError("read elapsed_s after the `with timer:` block has exited")
        self._end_event.synchronize()
        return self._start_event.elapsed_time(self._end_event) / 1000


class TorchDeviceAccelerator(Accelerator):
    """An accelerator whose every call goes to `torch.<device_type>` (see the module docstring)."""

    @classmethod
    def module(cls) -> ModuleType:
        """torch.<device_type>, after importing the vendor package that registers it."""
        if cls.vendor_module:
            importlib.import_module(cls.vendor_module)
        module = getattr(torch, cls.device_type, None)
        if module is None:
            raise RuntimeError(f"torch.{cls.device_type} does not exist in torch {torch.__version__}")
        return module

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when usable; else what is missing: the package, the torch module or a device."""
        if cls.vendor_module and importlib.util.find_spec(cls.vendor_module) is None:
            return f"{cls.vendor_module} is not installed"
        try:
            module = cls.module()
            if not module.is_available() or module.device_count() < 1:
                return f"torch.{cls.device_type} sees no device (driver, visible devices?)"
        except Exception as e:  # a broken vendor install must not break detection of the others
            return f"{type(e).__name__}: {e}"
        return None

    @classmethod
    def is_available(cls) -> bool:
        """Whether the vendor package (if any) imports and torch.<type> sees a device."""
        return cls.unavailable_reason() is None

    def device_module(self) -> ModuleType:
        """torch.<device_type> itself: it already has torch.cuda's API."""
        return self.module()

    def device(self, local_rank: int | None = None) -> torch.device:
        """<type>:<local_rank>, or the current device when local_rank is None."""
        index = self.module().current_device() if local_rank is None else local_rank
        return torch.device(self.device_type, index)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to device `local_rank`."""
        self.module().set_device(local_rank)

    def device_count(self) -> int:
        """Devices of this type visible to the process."""
        return self.module().device_count()

    def synchronize(self) -> None:
        """Wait for all work queued on the current device."""
        self.module().synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""
        self.module().manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor | None:
        """The current device's generator state (a CPU ByteTensor)."""
        return self.module().get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore the current device's generator; None (a CPU checkpoint) leaves it alone."""
        if state is not None:
            self.module().set_rng_state(state)

    def memory_stats(self) -> dict[str, float]:
        """The device allocator's figures for the current device, in GiB."""
        module = self.module()
        return {
            "allocated_gb": module.memory_allocated() / _GIB,
            "peak_gb": module.max_memory_allocated() / _GIB,
            "reserved_gb": module.memory_reserved() / _GIB,
        }

    def reset_peak_memory(self) -> None:
        """Restart the allocator's peak counters for the current device."""
        self.module().reset_peak_memory_stats()

    def timer(self) -> EventTimer:
        """An event-based timer; see EventTimer."""
        return EventTimer(self.module())

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """fp16, and bf16 where the device module says the device has it."""
        is_bf16 = getattr(self.module(), "is_bf16_supported", None)
        return (torch.bfloat16, torch.float16) if is_bf16 and is_bf16() else (torch.float16,)

    def pin_memory_available(self) -> bool:
        """True: discrete devices copy asynchronously from page-locked host memory."""
        return True

    def device_name(self) -> str:
        """Product name of the current device as the device module reports it."""
        return self.module().get_device_name()
