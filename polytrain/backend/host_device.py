"""torch.cuda's API for a device without queues of its own: the host CPU (and, in part, Apple MPS).

torch.cpu offers only a few stubs (its Event cannot time, it has no memory statistics), so the
CUDA shim serves `torch.cuda` on the CPU from a `HostDevice`. What it does differs from a GPU
only where the host has nothing to do:

- every op has finished when it returns, so streams are already in order, `synchronize` and
  `Event.synchronize` return at once, and an Event's host clock at `record()` is exact;
- memory is the process's resident set (no caching allocator: allocated == reserved);
- the random generator is torch's CPU generator, shared with `torch.manual_seed`;
- the host counts as one device per local rank (LOCAL_WORLD_SIZE), so CUDA code that does
  `set_device(local_rank)` and `local_rank % device_count()` runs as it would on a node with
  one GPU per rank; all of them are the same memory.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polytrain.backend.flops import cpu_model


def rss_bytes() -> int:
    """Resident set size of this process now (falls back to the peak where /proc is missing)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """High-water mark of the resident set: VmHWM (resettable) or ru_maxrss."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource  # Unix-only, so imported only on this fallback path

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS through /proc/self/clear_refs (Linux >= 4.0); best effort."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def host_memory_info() -> tuple[int, int]:
    """(available, total) bytes of host memory, as torch.cuda.mem_get_info orders them."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return fields.get("MemAvailable", total), total


class HostEvent:
    """torch.cuda.Event on the host: `record()` reads the clock, which is exact because the
    work before it has already run. `elapsed_time` is in milliseconds, as on CUDA."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def elapsed_time(self, end_event: HostEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end_event._time - self._time) * 1000

    def synchronize(self) -> None:
        """Nothing to wait for: the recorded work has finished."""

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        """Streams are already ordered on the host."""


class HostStream(torch.Stream):
    """torch.cuda.Stream on the host: one in-order queue that is always drained. A torch.Stream
    of the CPU, so torch's own signatures (`Tensor.record_stream`) and isinstance checks take it."""

    def __new__(cls, device: Any = None, priority: int = 0, **_: Any) -> HostStream:
        return super().__new__(cls, device="cpu", priority=priority)

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.priority = priority

    def synchronize(self) -> None:
        """Already drained."""

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: Any) -> None:
        """Already ordered."""

    def wait_event(self, event: Any) -> None:
        """Already ordered."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<polytrain HostStream priority={self.priority}>"


_DEFAULT_STREAM = HostStream()


@dataclass(frozen=True)
class HostDeviceProperties:
    """What torch.cuda.get_device_properties reports, for the host. Compute capability 0.0 says
    "no CUDA architecture", so code gating CUDA-only kernels on it (flash attention, fp8) skips them."""

    name: str
    total_memory: int
    multi_processor_count: int
    major: int = 0
    minor: int = 0
    is_integrated: bool = True
    is_multi_gpu_board: bool = False
    gcnArchName: str = ""  # noqa: N815 - torch's field; read by inductor's cache key off CUDA


class HostDevice:
    """torch.cuda's API (the names the CUDA shim serves) for the host; see the module docstring."""

    Event = HostEvent
    Stream = HostStream

    def __init__(self) -> None:
        self._local = threading.local()  # current stream and device are per thread, as in CUDA

    # --- devices -------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def init(self) -> None:
        """Nothing to initialise."""

    def device_count(self) -> int:
        """One device per local rank of the job (1 outside a launcher)."""
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, index: int) -> None:
        if index is None or index < 0:  # torch.cuda.set_device(-1) is a no-op too
            return
        if index >= self.device_count():
            raise RuntimeError(
                f"set_device({index}): the host is presented as {self.device_count()} device(s), "
                f"one per local rank (LOCAL_WORLD_SIZE); start the job with that many ranks")
        self._local.index = index

    @contextlib.contextmanager
    def device(self, index: int | None) -> Any:
        """Context that makes `index` the current device, like torch.cuda.device."""
        previous = self.current_device()
        self.set_device(index if isinstance(index, int) else previous)
        try:
            yield
        finally:
            self._local.index = previous

    def device_of(self, tensor: torch.Tensor) -> Any:
        return self.device(self.current_device())

    def synchronize(self, device: Any = None) -> None:
        """Every op has finished when it returns."""

    def get_device_name(self, device: Any = None) -> str:
        return cpu_model()

    def get_device_properties(self, device: Any = None) -> HostDeviceProperties:
        return HostDeviceProperties(name=cpu_model(), total_memory=host_memory_info()[1],
                                    multi_processor_count=os.cpu_count() or 1)

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return (0, 0)

    def get_arch_list(self) -> list[str]:
        return []

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        """True: CPU autocast computes in bf16 on every CPU (natively on AVX512-BF16/AMX)."""
        return True

    def is_tf32_supported(self) -> bool:
        return False

    def can_device_access_peer(self, device: Any, peer: Any) -> bool:
        return True  # one memory

    # --- streams and events ----------------------------------------------------------------
    def current_stream(self, device: Any = None) -> HostStream:
        return getattr(self._local, "stream", _DEFAULT_STREAM)

    def default_stream(self, device: Any = None) -> HostStream:
        return _DEFAULT_STREAM

    def set_stream(self, stream: HostStream) -> None:
        self._local.stream = stream

    @contextlib.contextmanager
    def stream(self, stream: HostStream | None) -> Any:
        """Context that makes `stream` current (None: leave it), like torch.cuda.stream."""
        previous = self.current_stream()
        if stream is not None:
            self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    StreamContext = stream

    def is_current_stream_capturing(self) -> bool:
        return False  # there are no graphs to capture on the host

    # --- memory ------------------------------------------------------------------------------
    _seen_peak = 0  # the largest resident size a caller was told since the last reset

    def memory_allocated(self, device: Any = None) -> int:
        current = rss_bytes()
        self._seen_peak = max(self._seen_peak, current)
        return current

    def max_memory_allocated(self, device: Any = None) -> int:
        # The kernel's high-water mark lags the resident size by a few pages: never report a
        # peak below a size already reported.
        return max(rss_bytes(), peak_rss_bytes(), self._seen_peak)

    memory_reserved = memory_cached = memory_allocated
    max_memory_reserved = max_memory_cached = max_memory_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        reset_peak_rss()
        self._seen_peak = 0

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        """No accumulated counters on the host."""

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        current, peak = self.memory_allocated(), self.max_memory_allocated()
        stats = {"num_alloc_retries": 0, "num_ooms": 0}
        for kind in ("allocated_bytes", "reserved_bytes", "active_bytes"):
            stats[f"{kind}.all.current"], stats[f"{kind}.all.peak"] = current, peak
        return stats

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        gib = 2**30
        return (f"host memory: resident {self.memory_allocated() / gib:.2f} GiB, "
                f"peak {self.max_memory_allocated() / gib:.2f} GiB")

    def memory_snapshot(self, *args: Any, **kwargs: Any) -> list:
        return []

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return host_memory_info()

    def empty_cache(self) -> None:
        """No cache: freed tensors go straight back to the system allocator."""

    def ipc_collect(self) -> None:
        """Nothing shared across processes to collect."""

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """Not enforceable on the host; accepted so CUDA code runs unchanged."""

    def get_per_process_memory_fraction(self, device: Any = None) -> float:
        return 1.0

    # --- random numbers: torch's CPU generator ----------------------------------------------
    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return (torch.default_generator,) * self.device_count()

    def manual_seed(self, seed: int) -> None:
        # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which is this method.
        torch.default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    def seed(self) -> None:
        torch.default_generator.seed()

    seed_all = seed

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return torch.default_generator.get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.default_generator.set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state()] * self.device_count()

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        if new_states:
            self.set_rng_state(new_states[0])
