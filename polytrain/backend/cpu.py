"""The host CPU as an accelerator: always available, the fallback when no device is found."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

from polytrain.backend.base import Accelerator
from polytrain.backend.flops import cpu_model, cpu_peak_flops

_GIB = 2**30


def _rss_bytes() -> int:
    """Resident set size of this process now (falls back to the peak where /proc is missing)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """High-water mark of the resident set: VmHWM (resettable) or ru_maxrss."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource  # Unix-only, so imported only on this fallback path

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


class CPUAccelerator(Accelerator):
    """All CPU work of this process; one 'device' however many cores, shared by local ranks."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # gloo on one host, 12 MiB of fp32 over 2 ranks: reduce-scatter ~40 ms, all-reduce ~20 ms.
    reduce_scatter_by_all_reduce = True

    def __init__(self) -> None:
        self._peak_flops: dict[torch.dtype, float] = {}

    @classmethod
    def is_available(cls) -> bool:
        """Always true: every process has a CPU."""
        return True

    def device(self, local_rank: int | None = None) -> torch.device:
        """torch.device('cpu') for every rank."""
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        """Nothing to select: all ranks share the host."""

    def device_count(self) -> int:
        """1: the host counts as one device whatever the number of ranks on it."""
        return 1

    def synchronize(self) -> None:
        """CPU ops finish before they return, so there is nothing to wait for."""

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator, which is this device's generator."""
        torch.random.default_generator.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor | None:
        """None: the CPU generator is torch's global one, which callers save themselves."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """No-op, matching `get_rng_state`."""

    def memory_stats(self) -> dict[str, float]:
        """Process memory in GiB. allocated and reserved are both the resident set size
        (there is no caching allocator to tell them apart); peak is its high-water mark."""
        rss = _rss_bytes() / _GIB
        peak = max(rss, _peak_rss_bytes() / _GIB)
        return {"allocated_gb": rss, "peak_gb": peak, "reserved_gb": rss}

    def reset_peak_memory(self) -> None:
        """Reset VmHWM to the current RSS through /proc/self/clear_refs (Linux >= 4.0).

        Best effort: elsewhere the peak stays the whole process's peak.
        """
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        """bf16, plus fp16 where this torch build's CPU autocast accepts it."""
        dtypes = [torch.bfloat16]
        # Builds without CPU fp16 autocast warn and disable themselves instead of raising.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with contextlib.suppress(Exception):
                torch.autocast("cpu", dtype=torch.float16)
                dtypes.append(torch.float16)
        return tuple(dtypes)

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Measured once per machine, thread count, torch version and dtype (see flops.py);
        remembered here too, since the trainer asks at every log step."""
        if dtype not in self._peak_flops:
            self._peak_flops[dtype] = cpu_peak_flops(dtype)
        return self._peak_flops[dtype]

    def pin_memory_available(self) -> bool:
        """False: the device is host memory, so there is nothing to copy to (and no pinning API)."""
        return False

    def device_name(self) -> str:
        """The CPU model, e.g. 'AMD EPYC 7763 64-Core Processor'."""
        return cpu_model()

    def describe(self) -> str:
        """One line for logs: CPU model, threads and torch version."""
        return (
            f"cpu: {self.device_name()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}"
        )
