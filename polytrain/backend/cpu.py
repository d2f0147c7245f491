"""The host CPU as an accelerator: always available, the fallback when no device is found."""

from __future__ import annotations

import contextlib
import warnings

import torch

from polytrain.backend.base import Accelerator
from polytrain.backend.flops import cpu_model
from polytrain.backend.host_device import HostDevice, peak_rss_bytes, reset_peak_rss, rss_bytes
from polytrain.backend.peak import Peak

_GIB = 2**30


class CPUAccelerator(Accelerator):
    """All CPU work of this process; one 'device' however many cores, shared by local ranks."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # gloo on one host, 12 MiB of fp32 over 2 ranks: reduce-scatter ~40 ms, all-reduce ~20 ms.
    reduce_scatter_by_all_reduce = True

    def __init__(self) -> None:
        self._host = HostDevice()  # one, so the current device and stream it keeps persist

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
        rss = rss_bytes() / _GIB
        peak = max(rss, peak_rss_bytes() / _GIB)
        return {"allocated_gb": rss, "peak_gb": peak, "reserved_gb": rss}

    def reset_peak_memory(self) -> None:
        """Reset VmHWM to the current RSS through /proc/self/clear_refs (Linux >= 4.0).

        Best effort: elsewhere the peak stays the whole process's peak.
        """
        reset_peak_rss()

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

    def datasheet_peak(self, dtype: torch.dtype) -> Peak | None:
        """None: a CPU's rate depends on its SIMD units, clocks under load and the threads; it is measured."""
        return None

    def pin_memory_available(self) -> bool:
        """False: the device is host memory, so there is nothing to copy to (and no pinning API)."""
        return False

    def device_name(self) -> str:
        """The CPU model, e.g. 'AMD EPYC 7763 64-Core Processor'."""
        return cpu_model()

    def device_module(self) -> HostDevice:
        """torch.cuda's API for the host (see host_device.py), which the CUDA shim serves."""
        return self._host

    def describe(self) -> str:
        """One line for logs: CPU model, threads and torch version."""
        return (
            f"cpu: {self.device_name()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}"
        )
