"""Peak matmul FLOP/s, the denominator of MFU: a datasheet table for GPUs, a measurement for CPUs.

All GPU figures are dense (no 2:4 structured sparsity), per device, at boost clock, from the
vendors' datasheets. CPUs have no useful datasheet number (it depends on SIMD width, clocks
under load and the thread count), so we time a matmul once and cache the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Iterator

import torch

from polytrain.backend.host_gemm import onednn_available, onednn_product
from polytrain.io.atomic import write_text_atomic

# Ordered most specific first: the first key found in the device name wins, so
# "H100 NVL" must precede "H100" and "A100" must precede "A10".
_GPU_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("H200 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),  # SXM
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    # AWS's A10G runs tensor math with fp32 accumulation at half the A10's rate.
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L40", {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("RTX 4090", {"bf16": 165e12, "fp16": 165e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("RTX 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 tensor cores
    ("T4", {"fp16": 65e12, "fp32": 8.1e12}),
    ("MI325X", {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    ("MI300X", {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    ("MI300A", {"bf16": 980.6e12, "fp16": 980.6e12, "tf32": 490.3e12, "fp32": 122.6e12}),
    ("MI250X", {"bf16": 383e12, "fp16": 383e12, "fp32": 95.7e12}),  # fp32 = matrix cores
    ("MI250", {"bf16": 362.1e12, "fp16": 362.1e12, "fp32": 90.5e12}),
]

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Datasheet dense peak FLOP/s for a GPU product name, or None if the GPU or dtype is unknown.

    `tf32=True` asks for the TF32 tensor-core rate of float32 matmuls (falls back to plain
    fp32 on GPUs without TF32).
    """
    key = _DTYPE_KEYS.get(dtype)
    if key is None:
        return None
    for product, peaks in _GPU_PEAK_FLOPS:
        # Word boundaries so "T4" does not match inside other names.
        if re.search(rf"\b{re.escape(product)}\b", name, re.IGNORECASE):
            if tf32 and key == "fp32" and "tf32" in peaks:
                return peaks["tf32"]
            return peaks.get(key)
    return None


def cpu_model() -> str:
    """The CPU model string from /proc/cpuinfo, else what the platform module reports."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            # x86 says "model name"; many ARM kernels only say "Hardware" or "Model".
            field, _, value = line.partition(":")
            if field.strip() in ("model name", "Hardware", "Model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_dir() -> Path:
    """Where polytrain keeps machine-local caches: $POLYTRAIN_CACHE or ~/.cache/polytrain."""
    return Path(os.environ.get("POLYTRAIN_CACHE") or Path.home() / ".cache" / "polytrain")


def measure_matmul_flops(dtype: torch.dtype, budget_s: float = 0.5) -> float:
    """Best observed FLOP/s of a square CPU matmul in `dtype`, using torch's current threads.

    The size doubles until one matmul takes ~30 ms (capped at n=2048), then up to 4 timed
    reps fit in `budget_s`; so even slow paths such as bf16 on CPUs without bf16
    instructions finish in about a second. fp32 is timed on the BLAS and on oneDNN, the faster
    counting: training runs its fp32 products on oneDNN where that is faster
    (train.fp32_gemm), and a peak below what its products reach would inflate MFU.
    """
    n = 128
    while True:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warmup: the first call at a size pays one-off setup
        start = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - start
        if took >= 0.03 or n >= 2048:
            break
        n *= 2
    reps = max(1, min(4, int(budget_s / max(took, 1e-9))))
    products = [lambda: torch.mm(a, b)]
    if dtype == torch.float32 and onednn_available():  # a @ b.T: the same FLOPs
        products.append(lambda: onednn_product(a, b, None))
    best = took
    for product in products:
        product()  # warmup
        for _ in range(reps):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` so ranks sharing a host measure one at a time
    (concurrent benchmarks would steal each other's cores) and then read the cache."""
    try:
        import fcntl
    except ImportError:  # not POSIX: measure unlocked
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_peak_flops(dtype: torch.dtype) -> float:
    """Measured CPU matmul FLOP/s for `dtype`, cached per (CPU model, threads, torch, dtype)."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "peak_flops.json"
    # "blas+onednn": fp32 entries cached before oneDNN was timed too are measured again.
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|blas+onednn|{dtype}"
    with _locked(directory / "peak_flops.lock"):
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        entry = cache.get(key)
        if not isinstance(entry, dict) or not entry.get("settled"):
            # A measurement taken while other work loads the machine comes out low
            # and would inflate every MFU after it: keep the best seen, and measure
            # again next time until one was taken on a quiet machine.
            best = max(measure_matmul_flops(dtype), entry.get("flops", 0.0) if isinstance(entry, dict) else 0.0)
            cache[key] = entry = {"flops": best, "settled": _machine_is_quiet()}
            write_text_atomic(path, json.dumps(cache, indent=1, sort_keys=True))  # never half-written
    return float(entry["flops"])


def _machine_is_quiet() -> bool:
    """True when the 1-minute load average leaves the cores this process uses free."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return True
    return load + torch.get_num_threads() <= (os.cpu_count() or 1) + 0.5
