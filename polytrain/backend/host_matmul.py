"""Few-row products on the host CPU that read each weight from memory once: `thin_linear`.

Decoding multiplies one token per sequence by every weight of the model, so a step is a few
rows (2-8 at batch 2-8) times each weight, and its time is the time to read the weights.
torch's CPU BLAS runs such a product as a GEMM that first packs a panel of the weight into a
buffer, and at a few rows packing is most of the work: on this project's 2-core Xeon F.linear
reads llama 125m's weights at 7-13 GB/s with 8 rows, where one row (a GEMV, which streams the
weight) reads them at 21-27 GB/s. host_matmul.cpp streams the weight for every row count: each
thread walks its own block of weight rows against every row of x (held in L1), two weight rows
side by side so that each x vector loaded serves both, while the rows two passes ahead are
prefetched into L2 (into L1 they competed with x). On a 2-core Zen 4 EPYC it reads llama 125m's
weights at 19-29 GB/s with 1 row (fp32 and bf16; F.linear 7-15) and 15-28 GB/s with 8 (F.linear
5-12) (`benchmarks/threaded_matmul.py`, RESULTS.md). Sums are fp32, one rounding at the end, as
F.linear's bf16 result is rounded. bf16 weights are widened to fp32 in registers; where the CPU
has AVX512-BF16 (Zen 4, Cooper Lake and later Xeons) VDPBF16PS multiplies pairs of bf16 inputs
and adds them to fp32 instead, 32 inputs an instruction, reading bf16 inputs below 2^-126 as
zero.

On a CPU with AMX (Sapphire Rapids and later Xeons) bf16 products run on its tile unit instead
(host_matmul_amx.h): one instruction multiplies 16 weight rows x 32 inputs by up to 16 rows of
x, and a weight tile serves three such tiles of x, so 8-48 rows read the weights near the
memory's rate where the FMAs bound the loop above (llama 125m's (32000, 768) weight at 20.5 /
21.4 GB/s with 8 / 16 rows against the FMA loop's 15.6 / 10.0 before its row order changed, a
2-core Sapphire Rapids Xeon). Its sums are fp32 and rounded once as well, but it reads bf16
inputs below 2^-126 as zero. `uses_amx()` says whether it runs here;
`POLYTRAIN_HOST_AMX=0` keeps the FMA loop.

Each output is the same dot product F.linear computes, summed in another order: it differs
from F.linear's by fp32 rounding (about 1e-6 relative), not bitwise.

The kernel is C++ built on first use with torch's extension builder and the host's compiler
(`-march=native`: this CPU's vector width), once per machine, source and torch version, into
the polytrain cache (`$POLYTRAIN_CACHE/kernels`, about 8 s). Where it cannot be built (no
compiler, another platform) `available()` is False, says why once, and callers keep F.linear;
`POLYTRAIN_HOST_KERNELS=0` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from polytrain.backend.flops import cache_dir

SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("host_matmul.cpp", "host_attention.cpp", "host_flash_attention.cpp", "host_cross_entropy.cpp",
                 "host_activations.cpp"))
"""Built into one extension: thin_linear here, decode_attention (host_attention.py), training's
flash_attention (host_flash_attention.py), the chunked loss's chunk_lse and chunk_grad
(host_cross_entropy.py) and the feed-forward activations (host_activations.py) beside it."""
HEADERS = (Path(__file__).with_name("host_matmul_amx.h"), Path(__file__).with_name("host_vectors.h"))
"""Included by SOURCES: part of what a build is keyed on."""
ENV_VAR = "POLYTRAIN_HOST_KERNELS"


def thin_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ weight (out, in).T + bias (out,) -> (M, out), fp32 or bf16, contiguous host
    tensors of one dtype; only once `available()` is True."""
    return torch.ops.polytrain.thin_linear(x, weight, bias)


def uses_amx() -> bool:
    """Whether bf16 products run on AMX's tile unit here (host_matmul_amx.h): built on a CPU with
    AMX-BF16 and given the tile state by the OS. False where the kernel is not available."""
    return available() and torch.ops.polytrain.thin_linear_uses_amx()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compile_flags() -> list[str]:
    """The C++ flags the kernels are built with: this CPU's own vector instructions."""
    arch = "-march=native" if platform.machine() in ("x86_64", "AMD64", "i686") else "-mcpu=native"
    return ["-O3", arch, "-fopenmp"]


def _build_dir() -> Path:
    """One directory per source, torch, Python and CPU: a shared cache never hands a kernel built
    for one machine's vector instructions to another."""
    sources = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(b"\0".join([*sources, torch.__version__.encode(), sys.version.encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / "kernels" / f"host_matmul-{key}"


def _load_built(build: Path) -> bool:
    """Load the library a finished build left in `build` (keyed by the sources' bytes, so never stale):
    about 1 ms, where torch's builder spends ~0.5 s checking it is up to date, in every process that
    trains on the host. False where there is none, or a build is under way (its lock file)."""
    library = build / "polytrain_host_matmul.so"
    if not library.exists() or (build / "lock").exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:  # unreadable or cut short: the builder makes it again
        return False
    return True


@functools.cache
def available() -> bool:
    """Whether the host kernels (torch.ops.polytrain.thin_linear, decode_attention, flash_attention,
    chunk_lse, chunk_grad, gelu_tanh and silu_mul) are loaded in this process, built first if needed."""
    if os.environ.get(ENV_VAR, "1").strip() == "0":
        return False
    build = _build_dir()
    try:
        if not _load_built(build):
            from torch.utils import cpp_extension

            build.mkdir(parents=True, exist_ok=True)
            print(f"polytrain: building the host kernels (matmul, attention, loss) once for this machine into {build}",
                  file=sys.stderr, flush=True)
            cpp_extension.load(name="polytrain_host_matmul", sources=[str(f) for f in SOURCES],
                               build_directory=str(build), extra_cflags=compile_flags(), is_python_module=False,
                               verbose=False)
    except Exception as e:  # no compiler, an unsupported flag, a failed build: F.linear stays
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"polytrain: the host kernels could not be built ({reason}); decoding uses "
                      f"F.linear and SDPA ({ENV_VAR}=0 silences this)", stacklevel=2)
        return False
    torch.library.register_fake("polytrain::thin_linear")(
        lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))
    torch.library.register_fake("polytrain::decode_attention")(lambda q, k, v, mask, scale: q.new_empty(q.shape))
    for hook in _when_loaded:
        hook()
    return True


_when_loaded: list[Callable[[], None]] = []


def when_loaded(hook: Callable[[], None]) -> None:
    """Run `hook()` (registering an operator's fake or backward) once the kernels are loaded in this
    process: now if they are, else when `available()` loads them. The other host_* modules register
    theirs this way, so this module imports none of them."""
    if available.cache_info().currsize and available():
        hook()
    else:
        _when_loaded.append(hook)
