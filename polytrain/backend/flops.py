"""Measured peak matmul FLOP/s: MFU's denominator on CPUs and on devices the datasheet table
(peak.py) does not know.

A CPU has no useful datasheet number (it depends on SIMD width, clocks under load and the thread
count), so we time matmuls and cache the best figure per (device, threads, torch, dtype) in
$POLYTRAIN_CACHE/peak_flops.json. A measurement is only ever a lower bound on the true peak (a
busy host, a cold clock), so the cached figure only rises: the first SETTLED_RUNS runs on a quiet
host each time it again and keep the best, and a training step faster than the figure raises it
(raise_measured_peak): an MFU above 100% is the proof the peak was low.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from polytrain.backend.host_gemm import onednn_available, onednn_product
from polytrain.backend.peak import Peak
from polytrain.io.atomic import write_text_atomic

SETTLED_RUNS = 3
"""Measurements on a quiet host after which start-ups read the cached peak instead of timing it again."""
MAX_RUNS = 8
"""Measurements in all after which start-ups read the cache even if the host was never quiet (a busy
CI machine): each costs about a second, and a step faster than the figure still raises it."""
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

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


def measure_matmul_flops(dtype: torch.dtype, budget_s: float = 0.5, device: torch.device | None = None,
                         synchronize: Callable[[], None] = lambda: None) -> float:
    """Best observed FLOP/s of a square matmul in `dtype` on `device` (default: the CPU, with
    torch's current threads); `synchronize` waits for the device's queued work.

    The size doubles from n=1024 until one matmul takes ~30 ms (capped at n=2048 on a CPU, 8192 on
    a device: three 8192^2 fp32 operands are 0.8 GB), then up to 4 (CPU) or 32 (device) timed reps
    fit in `budget_s`; so even slow paths such as bf16 on CPUs without bf16 instructions finish in
    about a second. Not from smaller sizes: on a busy host a 128 product's threads wait on each
    other's time slices for ~30 ms, a rate thousands of times too low. On a CPU fp32 is timed on
    the BLAS and on oneDNN, the faster counting: training runs its fp32 products on oneDNN where
    that is faster (train.fp32_gemm), and a peak below what its products reach would inflate MFU.
    """
    device = device or torch.device("cpu")
    on_cpu = device.type == "cpu"
    max_n, max_reps = (2048, 4) if on_cpu else (8192, 32)

    def seconds(product: Callable[[], torch.Tensor]) -> float:
        start = time.perf_counter()
        product()
        synchronize()
        return time.perf_counter() - start

    # Operands from a generator of our own: drawing from the global one would shift the training
    # run's random stream (initialisation, dropout, sampling) by whether the peak was timed.
    generator = torch.Generator(device=device).manual_seed(0)
    n = 1024
    while True:
        a = torch.randn(n, n, device=device, generator=generator).to(dtype)
        b = torch.randn(n, n, device=device, generator=generator).to(dtype)
        seconds(lambda: torch.mm(a, b))  # warmup: the first call at a size pays one-off setup
        took = seconds(lambda: torch.mm(a, b))
        if took >= 0.03 or n >= max_n:
            break
        n *= 2
    reps = max(1, min(max_reps, int(budget_s / max(took, 1e-9))))
    products = [lambda: torch.mm(a, b)]
    if on_cpu and dtype == torch.float32 and onednn_available():  # a @ b.T: the same FLOPs
        products.append(lambda: onednn_product(a, b, None))
    best = took
    for product in products:
        seconds(product)  # warmup
        for _ in range(reps):
            best = min(best, seconds(product))
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


def measured_peak(dtype: torch.dtype, device: torch.device | None = None,
                  synchronize: Callable[[], None] = lambda: None, name: str = "") -> Peak:
    """The best matmul FLOP/s seen on `device` (default: this CPU; `name` the device's product name)
    in `dtype`, over this and earlier runs (see the module docstring).

    Until SETTLED_RUNS measurements were taken on a quiet host, each call measures again and keeps
    the higher of that and the cached figure: a measurement on a busy host never lowers it.
    """
    device = device or torch.device("cpu")
    on_cpu = device.type == "cpu"
    # The thread count sets a CPU's rate; the float32 matmul precision lets torch run fp32 as TF32
    # or bf16 products, a different rate.
    key = (f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}|blas+onednn|{dtype}"
           if on_cpu else f"{name}|{device.type}|torch={torch.__version__}|{dtype}")
    if dtype == torch.float32:
        key += f"|{torch.get_float32_matmul_precision()}"
    with _locked_cache() as cache:
        entry = cache.get(key) if isinstance(cache.get(key), dict) else {}
        if entry.get("quiet_runs", 0) < SETTLED_RUNS and entry.get("runs", 0) < MAX_RUNS:
            flops = measure_matmul_flops(dtype, device=device, synchronize=synchronize)
            # A device's rate does not depend on the host's load; a CPU's does.
            quiet = _machine_is_quiet() if on_cpu else True
            entry = {"flops": max(flops, entry.get("flops", 0.0)),  # only ever raised
                     "runs": entry.get("runs", 0) + 1, "quiet_runs": entry.get("quiet_runs", 0) + int(quiet),
                     "step_flops": entry.get("step_flops", 0.0), "dtype": _DTYPE_NAMES.get(dtype, str(dtype)),
                     "on": "this CPU" if on_cpu else f"this {name} (not in the datasheet table)"}
            cache[key] = entry
    return _peak(key, entry)


def raise_measured_peak(peak: Peak, flops: float) -> Peak:
    """`peak` raised to `flops`, a rate a training step reached, in the cache too, so later runs start from it.

    A step's model FLOP/s above the measured peak proves the measurement low (a busy host); the
    step's rate is then the best lower bound on the device's peak we have.
    """
    if peak.cache_key is None:
        raise ValueError(f"only a measured peak can be raised by a step, not {peak.describe()}")
    with _locked_cache() as cache:
        entry = cache.get(peak.cache_key)
        if not isinstance(entry, dict):  # the cache was deleted since: start an entry from `peak`
            entry = {"flops": peak.flops, "runs": 1, "quiet_runs": 0, "dtype": peak.dtype, "on": "this device"}
        entry["step_flops"] = max(flops, entry.get("step_flops", 0.0))
        cache[peak.cache_key] = entry
    return _peak(peak.cache_key, entry)


def cpu_peak_flops(dtype: torch.dtype) -> float:
    """This CPU's measured matmul FLOP/s for `dtype` with torch's current threads (see measured_peak)."""
    return measured_peak(dtype).flops


def _peak(key: str, entry: dict) -> Peak:
    measured, step, runs = entry["flops"], entry.get("step_flops", 0.0), entry["runs"]
    source = f"measured on {entry['on']}, best of {runs} run{'s' if runs != 1 else ''}"
    if step > measured:
        source += f", raised to a training step's {step / 1e12:.4g} TFLOP/s"
    return Peak(max(measured, step), entry["dtype"], f"{source}, cached in {_cache_path()}", key)


def _cache_path() -> Path:
    return cache_dir() / "peak_flops.json"


@contextlib.contextmanager
def _locked_cache() -> Iterator[dict]:
    """The peak cache as a dict, under the host-wide lock; written back (atomically) on leaving."""
    path = _cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        if not isinstance(cache, dict):
            cache = {}
        before = json.dumps(cache, sort_keys=True)
        yield cache
        if json.dumps(cache, sort_keys=True) != before:
            write_text_atomic(path, json.dumps(cache, indent=1, sort_keys=True))  # never half-written


def _machine_is_quiet() -> bool:
    """True when the 1-minute load average leaves the cores this process uses free."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return True
    return load + torch.get_num_threads() <= (os.cpu_count() or 1) + 0.5
