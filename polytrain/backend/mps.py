"""Apple-silicon GPUs through Metal (torch.mps).

torch.mps is not shaped like torch.cuda: one device, no streams, no device selection, memory
figures under other names. So MPSAccelerator implements the interface directly, and MPSDevice
gives the CUDA shim torch.cuda's names on top of the host's device model (one GPU shared by all
local ranks, like the host CPU) with Metal's synchronize, events, memory and generator.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.backend.base import Accelerator
from polytrain.backend.host_device import HostDevice, HostStream
from polytrain.backend.torch_device import EventTimer

_GIB = 2**30


class _PeakTracker:
    """Metal reports no peak: remember the highest allocation seen at any query."""

    peak = 0

    def update(self) -> int:
        _PeakTracker.peak = max(_PeakTracker.peak, torch.mps.current_allocated_memory())
        return _PeakTracker.peak

    def reset(self) -> None:
        _PeakTracker.peak = torch.mps.current_allocated_memory()


class MPSStream(HostStream):
    """Metal has one command queue per process: waiting on a stream waits for the GPU."""

    def synchronize(self) -> None:
        torch.mps.synchronize()


class MPSDevice(HostDevice):
    """torch.cuda's API for the MPS GPU (see the module docstring)."""

    Event = torch.mps.event.Event
    Stream = MPSStream

    def is_available(self) -> bool:
        return torch.backends.mps.is_available()

    def synchronize(self, device: Any = None) -> None:
        torch.mps.synchronize()

    def get_device_name(self, device: Any = None) -> str:
        return "Apple MPS"

    def memory_allocated(self, device: Any = None) -> int:
        return torch.mps.current_allocated_memory()

    def max_memory_allocated(self, device: Any = None) -> int:
        return _PeakTracker().update()

    def memory_reserved(self, device: Any = None) -> int:
        return torch.mps.driver_allocated_memory()

    max_memory_reserved = memory_reserved
    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        _PeakTracker().reset()

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        total = torch.mps.recommended_max_memory()
        return max(0, total - torch.mps.driver_allocated_memory()), total

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        torch.mps.set_per_process_memory_fraction(fraction)

    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return (torch.mps._get_default_mps_generator(),) * self.device_count()

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(int(seed))

    manual_seed_all = manual_seed

    def seed(self) -> None:
        torch.mps.seed()

    seed_all = seed

    def get_rng_state(self, device: Any = "mps") -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "mps") -> None:
        torch.mps.set_rng_state(new_state)


class MPSAccelerator(Accelerator):
    """The Apple-silicon GPU; ranks on one Mac share it and talk through gloo (torch's mps
    default), since Metal has no collective library."""

    name = "mps"
    device_type = "mps"
    dist_backend = "gloo"

    def __init__(self) -> None:
        self._device = MPSDevice()

    @classmethod
    def is_available(cls) -> bool:
        """Whether torch was built with MPS and runs on macOS with a Metal GPU."""
        return torch.backends.mps.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if cls.is_available():
            return None
        if not torch.backends.mps.is_built():
            return f"this torch ({torch.__version__}) was built without MPS"
        return "no Metal GPU (MPS needs macOS 12.3+ on Apple silicon or an AMD GPU)"

    def device_module(self) -> MPSDevice:
        return self._device

    def device(self, local_rank: int | None = None) -> torch.device:
        """torch.device('mps') for every rank: there is one GPU."""
        return torch.device("mps")

    def set_device(self, local_rank: int) -> None:
        """Nothing to select: one GPU."""

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor | None:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            torch.mps.set_rng_state(state)

    def memory_stats(self) -> dict[str, float]:
        """Metal's allocations in GiB; the peak is the highest seen at a query (Metal has none)."""
        return {
            "allocated_gb": self._device.memory_allocated() / _GIB,
            "peak_gb": self._device.max_memory_allocated() / _GIB,
            "reserved_gb": self._device.memory_reserved() / _GIB,
        }

    def reset_peak_memory(self) -> None:
        self._device.reset_peak_memory_stats()

    def timer(self) -> EventTimer:
        return EventTimer(torch.mps)

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """fp16 always; bf16 from macOS 14, where Metal added it."""
        newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
        return (torch.float16, torch.bfloat16) if newer and newer(14, 0) else (torch.float16,)

    def pin_memory_available(self) -> bool:
        """False: unified memory, there is no separate device memory to copy into."""
        return False

    def device_name(self) -> str:
        return self._device.get_device_name()
