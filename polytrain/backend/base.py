"""The Accelerator interface: everything polytrain asks of a device, in one place.

Training code talks only to an `Accelerator`, so supporting a new device means adding one
subclass here instead of touching models, data or the trainer.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from typing import Any, ContextManager

import torch

from polytrain.backend.flops import measured_peak
from polytrain.backend.peak import Peak, datasheet_peak


class Timer:
    """Wall-clock timer for a `with` block; `elapsed_s` is valid once the block has exited.

    Correct only where work finishes before the block exits (the CPU); asynchronous devices
    return their own timer from `Accelerator.timer()`.
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self._end: float | None = None

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        """Seconds between entering and leaving the `with` block."""
        if self._start is None or self._end is None:
            raise RuntimeError("read elapsed_s after the `with timer:` block has exited")
        return self._end - self._start


class Accelerator(ABC):
    """One kind of compute device (all devices of that kind on this host)."""

    name: str
    """Short name used in POLYTRAIN_ACCELERATOR and logs, e.g. 'cpu', 'cuda'."""
    device_type: str
    """torch device type string, e.g. 'cpu', 'cuda'."""
    dist_backend: str
    """torch.distributed backend for collectives between these devices."""
    vendor_module: str | None = None
    """The package that adds this device to torch (e.g. 'torch_npu'), or None where torch itself
    drives it. Imported only when the device is probed or used, never at polytrain import."""
    visible_devices_env: str = "POLYTRAIN_VISIBLE_DEVICES"
    """The environment variable that limits which of these devices a process sees (a
    comma-separated list of ids, e.g. CUDA_VISIBLE_DEVICES); a process's device i is the i-th
    listed. The elastic launcher lists the surviving devices in it when it restarts a job without
    a lost one. Devices without such a variable (the host CPU) keep polytrain's, which only the
    launcher and its workers read."""
    reduce_scatter_by_all_reduce: bool = False
    """Whether data parallelism reduce-scatters gradients as an all-reduce of the whole buffer
    (each rank keeps its piece): twice the bytes, but faster where the backend's
    reduce-scatter is much slower than its all-reduce (see distributed/reduce_scatter.py)."""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this process can use the device (hardware, driver and torch build)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why `is_available()` is False, in a few words a user can act on; None when available."""
        if cls.is_available():
            return None
        return "no usable device (check the driver, the torch build and visible devices)"

    def device_module(self) -> Any:
        """The torch.cuda-style module of this device (torch.xpu, torch.npu, ...): the object the
        CUDA shim (backend/compat) serves `torch.cuda` from. Names it lacks are reported by the
        shim as unmapped when called."""
        module = getattr(torch, self.device_type, None)
        if module is None:
            raise RuntimeError(f"torch has no torch.{self.device_type} module for {self.name}")
        return module

    @abstractmethod
    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch.device for `local_rank` (None = the current device)."""

    @abstractmethod
    def set_device(self, local_rank: int) -> None:
        """Make `local_rank`'s device the current one for this process."""

    @abstractmethod
    def device_count(self) -> int:
        """Devices of this kind visible to the process."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all queued work on the current device has finished."""

    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's random generator."""

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor | None:
        """The device generator's state for checkpoints; None if the device has none of its own."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore a state returned by `get_rng_state`."""

    @abstractmethod
    def memory_stats(self) -> dict[str, float]:
        """Memory in GiB: {'allocated_gb', 'peak_gb', 'reserved_gb'}."""

    @abstractmethod
    def reset_peak_memory(self) -> None:
        """Start a new peak for `memory_stats()['peak_gb']` (best effort where unsupported)."""

    @abstractmethod
    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """Reduced-precision dtypes `autocast` supports on this device."""

    @abstractmethod
    def pin_memory_available(self) -> bool:
        """Whether host memory can be page-locked for asynchronous copies to and from the device."""

    @abstractmethod
    def device_name(self) -> str:
        """Product name of the current device, e.g. 'NVIDIA H200' or the CPU model."""

    def dump_flight_recorder(self) -> str | None:
        """The collective library's own Flight Recorder as torch's JSON dump (entries, pg_status),
        for a library that records apart from torch's generic recorder (NCCL); None where it has
        none of its own (gloo's collectives are in the generic one, which the watchdog reads too)."""
        return None

    def peak(self, dtype: torch.dtype) -> Peak:
        """The peak matmul FLOP/s of one device in `dtype` that MFU divides by, and its source: the
        device's dense datasheet figure, else the best measured on it over runs (cached; flops.py)."""
        return self.datasheet_peak(dtype) or self.measured_peak(dtype)

    def datasheet_peak(self, dtype: torch.dtype) -> Peak | None:
        """This device's dense datasheet peak by its product name (peak.py's table); None if unknown."""
        return datasheet_peak(self.device_name(), dtype)

    def measured_peak(self, dtype: torch.dtype) -> Peak:
        """The best matmul FLOP/s measured on the current device, timed at most once per process."""
        # Per float32 matmul precision too: it lets float32 products run at another rate.
        key = (dtype, torch.get_float32_matmul_precision())
        peaks = self.__dict__.setdefault("_measured_peaks", {})
        if key not in peaks:
            peaks[key] = measured_peak(dtype, self.device(), self.synchronize, self.device_name())
        return peaks[key]

    def timer(self) -> Timer:
        """A `with` timer whose `elapsed_s` counts device work queued inside the block."""
        return Timer()

    def autocast(self, dtype: torch.dtype) -> ContextManager:
        """Mixed-precision context for this device; float32 means no autocast."""
        if dtype == torch.float32:
            return contextlib.nullcontext()
        supported = self.autocast_dtypes()
        if dtype not in supported:
            names = ", ".join(str(d) for d in supported) or "none"
            raise ValueError(f"{self.name} cannot autocast to {dtype}; supported: {names}")
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def describe(self) -> str:
        """One line for logs: device, count and software versions."""
        count, product = self.device_count(), self.device_name()
        return f"{self.name}: {count} x {product}, torch {torch.__version__}"
