"""Decoding's few-row matmuls: streamed through polytrain's host kernel, or split over threads.

A decoding step multiplies a few rows (batch x 1 token) by every weight of the model, and
on the host CPU torch's BLAS handles such thin products badly in two ways:

- at 2-16 rows it runs a GEMM that packs each weight panel before using it, reading llama
  125m's weights at 7-13 GB/s where the memory gives 25 (fp32, a 2-core Xeon). Up to
  STREAM_ROWS rows `threaded_linears` sends them to `backend.host_matmul.thin_linear`, which
  streams each weight once for all rows (on a 2-core Zen 4 EPYC 19-29 GB/s at one row, 15-28
  at 8 and 11-17 at 16, where F.linear reads 7-15, 5-12 and 4-10). Where that kernel runs
  bf16 on AMX's tile unit (`host_matmul.uses_amx()`), bf16 products of up to 48 rows, and
  prefills of up to 48 rows, go to it too: F.linear's bf16 GEMM reads the weights at 6-17 GB/s
  at 8-48 rows there, the kernel at 1.04-2.0x that. Its sums round as F.linear's do but in
  another order: outputs differ from F.linear's in the last bits, so a greedy token can change
  only where two logits tie within fp32 rounding. The choice is by row count and dtype, not timed, so a run gives
  the same bits every time on one machine.
- at one fp32 row it runs a GEMV, which streams the weight but, on some CPUs, on a single
  thread however many torch has: on a 2-core EPYC F.linear reads a llama 125m weight at 10-11
  GB/s with 2 threads, as with 1, while the memory gives 28 GB/s. Where the host kernel cannot
  be built, splitting the weight's output rows into one block per thread and multiplying the
  blocks as a batch (torch.bmm, which ATen runs in parallel over the batch) reads it at 12-20
  GB/s. Each block is the GEMM F.linear runs, so each output element is the same dot product
  summed in the same order (bitwise equal in every shape tested). Whether the split is faster
  depends on the shape and the machine, so it is measured: once per (out, in, rows, dtype,
  threads), on the model's own weights, each pass after the model's other weights have been
  read (as in decoding, none is hot in a cache), and kept only where it is clearly faster. On
  a CPU whose BLAS already threads the GEMV (an AVX-512 Xeon: 21-27 GB/s at one row) nothing
  is split.

`threaded_linears(model, rows)` replaces the forward of each plain nn.Linear held on the host
for the duration of generation (subclasses such as LoRA's, and sharded or wrapped layers, are
left alone) and restores it after; the model's code and parameters are untouched. Inputs of
more than `rows` rows (the prompts' prefill) and autocast inputs go to the layer's own forward
(F.linear, or for a bf16 weight on a CPU that emulates bf16 GEMMs the host kernel or fp32
GEMMs: `_many_rows`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.backend import host_gemm, host_matmul

MARGIN = 0.9
"""The split replaces F.linear only if it takes at most this fraction of F.linear's time."""
STREAM_ROWS = 16
"""The most rows streamed through the host kernel. At 16 rows it read llama 125m's weights at
1.1-3.0x F.linear's rate on a 2-core Zen 4 EPYC (bf16 and fp32), and at 0.97-1.11x (fp32) and
2.4-2.5x (bf16, emulated by the BLAS) on a 2-core Ice Lake Xeon before its prefetch into L2; at
32 rows its FMAs bind it and it is 0.98-2.1x F.linear's on the EPYC, so more rows go to the BLAS
(benchmarks/threaded_matmul.py, RESULTS.md)."""
STREAM_DTYPES = (torch.float32, torch.bfloat16)
AMX_STREAM_ROWS = 48
"""The most bf16 rows streamed where the host kernel runs them on AMX's tile unit, which reads each
weight once for up to 48 rows: 1.04-2.0x F.linear's GB/s at every llama 125m weight shape at 8-48
rows (llama 125m's (32000, 768) weight at 20.5, 21.4, 15.0 and 11.7 GB/s with 8, 16, 32 and 48
rows, F.linear's oneDNN GEMM at 13.3, 13.6, 12.0 and 10.0; a 2-core Sapphire Rapids Xeon,
benchmarks/threaded_matmul.py, RESULTS.md)."""
EMULATED_STREAM_ROWS = 64
"""A prefill of at most this many rows streams through the host kernel where the host emulates
its 16-bit GEMMs (`_many_rows`): the kernel's time grows with the rows (46, 74 and 163 ms at 16, 32
and 64 rows through llama 125m's bf16 weights) while fp32 GEMMs pay ~90 ms once to widen them."""


def split_linear(x: torch.Tensor, weight: torch.Tensor, blocks: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ weight.T + bias as `blocks` thin GEMMs, one per block of the weight's output rows:
    (P, M, in) @ (P, in, out / P) -> (M, out), each element computed as F.linear computes it.
    The bias goes into the GEMM's accumulator (baddbmm), as F.linear's addmm puts it: added
    after the product instead, bf16 outputs differ from F.linear's in their last bit."""
    m, k = x.shape
    a, b = x.expand(blocks, m, k), weight.view(blocks, -1, k).transpose(1, 2)
    parts = torch.bmm(a, b) if bias is None else torch.baddbmm(bias.view(blocks, 1, -1), a, b)  # (P, M, out/P)
    return parts.transpose(0, 1).reshape(m, -1)


_split_faster: dict[tuple, bool] = {}
"""(out, in, rows, dtype, threads) -> whether split_linear beat F.linear."""


FLUSH_BYTES = 512 * 1024 * 1024
"""At most this much of the model's other weights is read before each timed pass: more than
any last-level cache, so a shape whose weights fit in one is not timed hot in it, as decoding,
which reads every other weight between two uses of one, never finds it."""


def _paired_medians(ways: list[Callable[[], object]], before: Callable[[], object],
                    repeats: int = 3) -> list[float]:
    """Median seconds of each way, run in turn `repeats` times after one untimed run, each
    timed run after `before()` (which evicts the ways' operands from the caches)."""
    times: list[list[float]] = [[] for _ in ways]
    for repeat in range(repeats + 1):
        for way, way_times in zip(ways, times):
            before()
            start = time.perf_counter()
            way()
            if repeat:
                way_times.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _reader(tensors: list[torch.Tensor], limit: int = FLUSH_BYTES) -> Callable[[], object]:
    """A callable that reads `tensors` in turn, up to `limit` bytes of them."""
    chosen, total = [], 0
    for t in tensors:
        if total >= limit:
            break
        chosen.append(t)
        total += t.numel() * t.element_size()
    return lambda: [t.sum() for t in chosen]


def split_is_faster(weights: list[torch.Tensor], rows: int, blocks: int, others: list[torch.Tensor] = (),
                    time_s: Callable[..., list[float]] = _paired_medians) -> bool:
    """Whether `rows` rows times each of `weights` (one shape, out % blocks == 0) run faster split.

    Timed over all of the model's weights of the shape in turn, as a decoding step reads
    them, each pass after reading the model's `others` (its weights of other shapes), so that
    a shape is measured as cold in the caches as decoding finds it: on a CPU whose last-level
    cache holds a shape's weights, timing them hot picked the split where it is slower."""
    key = (*weights[0].shape, rows, weights[0].dtype, blocks)
    if key not in _split_faster:
        # its own generator: the global stream a caller's sampling draws from stays untouched
        x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            base, split = time_s([lambda: [F.linear(x, w) for w in weights],
                                  lambda: [split_linear(x, w, blocks) for w in weights]], _reader(list(others)))
        _split_faster[key] = split <= MARGIN * base
    return _split_faster[key]


def _eligible(module: nn.Module) -> bool:
    """A plain nn.Linear with a plain, contiguous host weight, whose forward is its class's or one
    marked `yields_to_inference` (train.matmul_fp32's, put back on exit): any other instance forward
    (a user's own, or an enclosing threaded_linears') is neither replaced nor deleted on exit."""
    own = module.__dict__.get("forward")
    if type(module) is not nn.Linear or (own is not None and not getattr(own, "yields_to_inference", False)):
        return False
    weight = module.weight
    return type(weight) is nn.Parameter and weight.device.type == "cpu" and weight.is_contiguous()


def _stream_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` a decoding product streams through the host kernel (0: none)."""
    if dtype not in STREAM_DTYPES or not host_matmul.available():
        return 0
    return AMX_STREAM_ROWS if dtype == torch.bfloat16 and host_matmul.uses_amx() else STREAM_ROWS


def _streams(dtype: torch.dtype, rows: int) -> bool:
    """Whether products of `rows` rows in `dtype` go through the host kernel (module docstring)."""
    return rows <= _stream_rows(dtype)


def _many_rows(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a layer without its own forward multiplies more rows than decoding's (a prefill).

    F.linear, except for a 16-bit weight whose GEMMs the host CPU emulates: there up to
    EMULATED_STREAM_ROWS rows of bf16 stream through the host kernel (each weight read once, its
    sums fp32), more rows (and fp16) run as fp32 GEMMs of the widened operands rounded back (backend.host_gemm, as
    train.matmul_fp32 runs a trained model's layers). A prefill of llama 125m in bf16, prompts of
    32 tokens, on an Ice Lake Xeon (medians of 7): 8 prompts 746 ms emulated, 320 ms through fp32
    GEMMs; one prompt 127-158 ms emulated, 120 ms through fp32 GEMMs (widening every weight costs
    ~90 ms of it), 97 ms streamed. Where the kernel runs bf16 on AMX, up to AMX_STREAM_ROWS rows
    stream through it and more go to F.linear."""
    weight, bias = module.weight, module.bias
    plain = lambda x: F.linear(x, weight, bias)  # noqa: E731
    emulated = host_gemm.emulates(weight.dtype)
    if emulated:
        limit = EMULATED_STREAM_ROWS if weight.dtype in STREAM_DTYPES and host_matmul.available() else 0
    elif weight.dtype == torch.bfloat16 and host_matmul.uses_amx():
        limit = AMX_STREAM_ROWS
    else:
        return plain

    def forward(x: torch.Tensor) -> torch.Tensor:  # x (..., in) -> (..., out)
        if x.dtype != weight.dtype or torch.is_autocast_enabled(x.device.type):  # F.linear's casting rules
            return plain(x)
        m = x.numel() // x.shape[-1]
        if m <= limit:
            return host_matmul.thin_linear(x.reshape(m, -1).contiguous(), weight, bias).view(*x.shape[:-1], -1)
        return host_gemm.linear(x, weight, bias, weight.dtype) if emulated else plain(x)

    return forward


def _thin_forward(module: nn.Linear, rows: int, way: str,
                  product: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """module's forward with inputs of at most `rows` rows computed as product(x (m, in)) -> (m, out),
    others by the forward it had (or `_many_rows`); `forward.way` names the product ("split" or "stream")."""
    before = module.__dict__.get("forward") or _many_rows(module)

    def forward(x: torch.Tensor) -> torch.Tensor:  # x (..., in) -> (..., out)
        m = x.numel() // x.shape[-1]
        if m > rows or x.dtype != module.weight.dtype:  # prefill, or a caller's autocast: as before
            return before(x)
        return product(x.reshape(m, -1).contiguous()).view(*x.shape[:-1], -1)

    forward.way = way
    return forward


def _split_forward(module: nn.Linear, rows: int, blocks: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return _thin_forward(module, rows, "split", lambda x: split_linear(x, module.weight, blocks, module.bias))


def _stream_forward(module: nn.Linear, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return _thin_forward(module, rows, "stream", lambda x: host_matmul.thin_linear(x, module.weight, module.bias))


def _thin_way(shape: tuple, weights: dict[tuple, list[torch.Tensor]], rows: int,
              blocks: int) -> Callable[[nn.Linear], Callable] | None:
    """How products of `rows` rows with the weights of `shape` (out, in, dtype) run: a maker of
    the layer's forward, or None to leave F.linear."""
    out_features, _, dtype = shape
    if _streams(dtype, rows):
        return lambda module: _stream_forward(module, rows)
    if blocks > 1 and out_features % blocks == 0:
        others = [w for other, ws in weights.items() if other != shape for w in ws]
        if split_is_faster(weights[shape], rows, blocks, others):
            return lambda module: _split_forward(module, rows, blocks)
    return None


@contextlib.contextmanager
def threaded_linears(model: nn.Module, rows: int, enabled: bool = True):
    """While inside, inputs of at most `rows` rows to the model's eligible Linear layers stream
    through the host kernel, or are split over torch's threads where that measured faster for
    their shape (module docstring); every layer's own forward is back on exit. Yields the
    number of layers changed."""
    patched, before = [], {}
    if enabled:
        by_shape: dict[tuple, list[nn.Linear]] = {}
        for module in model.modules():
            if _eligible(module):
                by_shape.setdefault((*module.weight.shape, module.weight.dtype), []).append(module)
        weights = {shape: [m.weight.detach() for m in modules] for shape, modules in by_shape.items()}
        for shape, modules in by_shape.items():
            make_forward = _thin_way(shape, weights, rows, torch.get_num_threads())
            if make_forward is not None:
                for module in modules:
                    before[module] = module.__dict__.get("forward")
                    module.forward = make_forward(module)
                patched += modules
    try:
        yield len(patched)
    finally:
        for module in patched:
            if before[module] is None:
                del module.forward
            else:
                module.forward = before[module]
