"""The peak matmul FLOP/s MFU divides by, and where it comes from: a vendor datasheet or a measurement.

    datasheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16)
    # Peak(flops=989e12, dtype="bf16", source="H100 SXM datasheet, dense")

The table holds only dense figures (no 2:4 structured sparsity, which datasheets quote at twice
the rate), per device, at boost clock, for the products we are sure of. A device it does not
know gets a measured peak instead (flops.py), and its source says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peak:
    """A peak matmul FLOP/s of one device, the dtype it is for, and where the figure comes from."""

    flops: float
    dtype: str
    """'bf16', 'fp16', 'tf32' (float32 products on tensor cores) or 'fp32'."""
    source: str
    """e.g. 'H100 SXM datasheet, dense' or 'measured on this CPU, best of 3 runs, cached in ...'."""
    cache_key: str | None = None
    """A measured peak's entry in the cache (flops.py), which a faster training step raises;
    None for datasheet figures, which no step may raise."""

    def describe(self) -> str:
        """'989 TFLOP/s bf16 (H100 SXM datasheet, dense)'."""
        return f"{self.flops / 1e12:.4g} TFLOP/s {self.dtype} ({self.source})"


_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (name pattern, product, dense FLOP/s: 16-bit (bf16 and fp16 alike), TF32, fp32; None where the
# device lacks the tensor-core path). Ordered most specific first: the first pattern found in the
# device name wins, so "H100 NVL" precedes "H100" and "A100" precedes "A10".
_DATASHEETS: list[tuple[str, str, float, float | None, float]] = [
    # Blackwell: the GB200 NVL72 and HGX B200 datasheets' figures over their 72 and 8 GPUs, sparsity halved.
    ("GB200", "GB200", 2.5e15, 1.25e15, 80e12),
    ("B200", "B200", 2.25e15, 1.125e15, 75e12),
    ("GH200", "GH200", 989e12, 494.5e12, 67e12),
    ("H200 NVL", "H200 NVL", 835e12, 417.5e12, 60e12),
    ("H200", "H200 SXM", 989e12, 494.5e12, 67e12),
    ("H100 NVL", "H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100 PCIe", "H100 PCIe", 756e12, 378e12, 51e12),
    ("H100", "H100 SXM", 989e12, 494.5e12, 67e12),
    ("H20", "H20", 148e12, 74e12, 44e12),
    ("A100", "A100", 312e12, 156e12, 19.5e12),
    ("A800", "A800", 312e12, 156e12, 19.5e12),  # an A100's cores
    ("A10G", "A10G", 70e12, 35e12, 31.2e12),  # AWS's: tensor math with fp32 accumulation at half the A10's rate
    ("A10", "A10", 125e12, 62.5e12, 31.2e12),
    ("L40S", "L40S", 362e12, 183e12, 91.6e12),
    ("L40", "L40", 181e12, 90.5e12, 90.5e12),
    ("L4", "L4", 121e12, 60e12, 30.3e12),
    ("RTX 4090", "RTX 4090", 165e12, 82.6e12, 82.6e12),
    ("RTX 3090", "RTX 3090", 71e12, 35.6e12, 35.6e12),
    ("V100", "V100", 125e12, None, 15.7e12),  # fp16 only: no bf16 tensor cores
    ("T4", "T4", 65e12, None, 8.1e12),  # fp16 only
    # AMD Instinct: fp32 is the matrix cores' rate. The MI355X has no TF32.
    ("MI355X", "MI355X", 2.5e15, None, 157.3e12),
    ("MI325X", "MI325X", 1307e12, 653.7e12, 163.4e12),
    ("MI300X", "MI300X", 1307e12, 653.7e12, 163.4e12),
    ("MI300A", "MI300A", 980.6e12, 490.3e12, 122.6e12),
    ("MI250X", "MI250X", 383e12, None, 95.7e12),
    ("MI250", "MI250", 362.1e12, None, 90.5e12),
]
_NO_BF16 = ("V100", "T4")

def datasheet_peak(name: str, dtype: torch.dtype, tf32: bool = False) -> Peak | None:
    """The dense datasheet peak of a device product name for `dtype`; None if the device or dtype is unknown.

    `tf32=True` asks for the TF32 tensor-core rate of float32 products (plain fp32 on devices
    without TF32).
    """
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        return None
    for pattern, product, half, tf32_rate, fp32 in _DATASHEETS:
        # Word boundaries so "T4" does not match inside other names, nor "H20" inside "H200".
        if re.search(rf"\b{re.escape(pattern)}\b", name, re.IGNORECASE):
            if key == "bf16" and pattern in _NO_BF16:
                return None
            if key == "fp32" and tf32 and tf32_rate is not None:
                key, fp32 = "tf32", tf32_rate
            return Peak(fp32 if key in ("fp32", "tf32") else half, key, f"{product} datasheet, dense")
    return None
