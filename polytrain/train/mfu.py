"""Model FLOPs utilization of training steps against one device's peak, never above 100%.

    mfu = MFU(acc.peak(gemm_dtype(torch.bfloat16, fp32_matmuls)))
    print(mfu.describe())                       # 'MFU against 989 TFLOP/s bf16 (H100 SXM datasheet, dense)'
    value, note = mfu.of(tokens_per_s * flops_per_token / world_size)   # model FLOP/s per device

A step faster than the peak means the peak is wrong, not that the device beat it. A measured
peak (CPUs, devices the datasheet table lacks) is a lower bound timed at some start-up, maybe on a
busy host: the step's rate is then the best figure we have for the peak, so the peak is raised to
it, in the cache too (the step reads 100%; later steps and runs are held to it). A datasheet peak
stays: a step above it means the FLOPs-per-token formula counts more than ran, so MFU is capped at
100%. Either way a note says what happened, once per raise or once per run.
"""

from __future__ import annotations

import torch

from polytrain.backend.flops import raise_measured_peak
from polytrain.backend.peak import Peak


def gemm_dtype(autocast_dtype: torch.dtype, fp32_matmuls: bool) -> torch.dtype:
    """The dtype whose peak a run's products are held to: float32 where they run as fp32 GEMMs
    (train.matmul_fp32), not the emulated 16-bit GEMM's (a third of it or less: MFU over 100%)."""
    return torch.float32 if fp32_matmuls else autocast_dtype


class MFU:
    """Model FLOP/s per device as a fraction of `peak`, at most 1 (see the module docstring)."""

    def __init__(self, peak: Peak) -> None:
        self.peak = peak
        self._capped = False  # a datasheet peak was beaten once: say so once

    def describe(self) -> str:
        """The start-up line: which peak MFU is against and where that figure comes from."""
        return f"MFU against {self.peak.describe()}"

    def of(self, flops_per_s: float) -> tuple[float, str | None]:
        """(MFU of a step that ran `flops_per_s` model FLOP/s per device, a note when its peak was beaten)."""
        if flops_per_s <= self.peak.flops:
            return flops_per_s / self.peak.flops, None
        beaten = self.peak
        if beaten.cache_key is not None:
            self.peak = raise_measured_peak(beaten, flops_per_s)
            return flops_per_s / self.peak.flops, (
                f"a step ran {flops_per_s / 1e12:.4g} TFLOP/s per device, above the measured peak "
                f"({beaten.flops / 1e12:.4g}, timed low, e.g. on a busy host): {self.describe()}")
        note = None if self._capped else (
            f"a step ran {flops_per_s / 1e12:.4g} TFLOP/s per device by the FLOPs-per-token count, above "
            f"{beaten.describe()}: the count exceeds the work that ran; MFU is shown capped at 100%")
        self._capped = True
        return 1.0, note
