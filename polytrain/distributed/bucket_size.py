"""ZeRO-1/2's gradient bucket size, chosen from the data-parallel group's measured reduce-scatter.

A reduction of b bytes costs about  t(b) = latency + b / bandwidth, two numbers `measure`
fits from two timed sizes on the path the buckets take (shared memory, gloo's all-reduce,
NCCL's reduce-scatter). Backward produces N bytes of gradient; in buckets of B bytes, N / B
reductions pay the latency, and the last bucket's reduction has no backward left to hide
behind. The step waits about

    wait(B) = (N / B) x latency + B / bandwidth,

least at B* = sqrt(N x latency x bandwidth), where the two terms are equal. Where a
reduction cannot overlap at all (the shared-memory path is synchronous), B* still keeps
the latency's share of the reduction time at 1 / (1 + sqrt(N / (latency x bandwidth))):
a few percent for any model worth sharding, at a fraction of a large bucket's memory.

B* is rounded down to a power of two, so a slightly different measurement rarely changes
it, and kept within [MIN_BUCKET_ELEMENTS, the configured reduce_bucket_mb]: the configured size
stays the memory bound (ZeRO-2 holds a bucket's full gradients until it is reduced; two
buckets' send buffers are in flight). Different runs may still pick different sizes, and
the gradient norm sums its per-bucket parts in a different order then (last-bit
differences), so runs that must repeat bit for bit set a fixed size.

    choice = choose_bucket_elements(group, rank, by_all_reduce, device, n_elements, cap)
    choice.elements, choice.describe()
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polytrain.distributed.reduce_scatter import start_reduce_scatter

FP32 = 4
"""Bytes per element of a reduction's buffer: buckets are reduced in fp32 whatever the weights' dtype."""
PROBE_ELEMENTS = (16 * 1024, 1024 * 1024)
"""The two (dp, S) buffer sizes timed, in elements: 64 KiB (mostly latency) and 4 MiB."""
ROUNDS, CALLS_PER_ROUND = 3, 4
"""Per size: rounds of back-to-back reductions (after one untimed); the median round's mean is kept."""
MIN_BUCKET_ELEMENTS = 64 * 1024
"""Fewest elements per bucket (256 KiB of fp32): below it per-bucket Python work dominates."""


@dataclass(frozen=True)
class ReductionCost:
    """t(b) = latency_s + b / bytes_per_s for one reduction of a (dp, S) fp32 buffer of b bytes."""

    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class BucketChoice:
    """The measured cost and the bucket size it gave, in elements of gradient."""

    cost: ReductionCost
    elements: int
    capped: bool
    """True when the configured reduce_bucket_mb decided the size (B* or the floor above it)."""

    def describe(self) -> str:
        bound = ", the configured bound" if self.capped else ""
        return (f"ZeRO buckets of {self.elements * FP32 / 2**20:g} MiB fp32{bound} (reduce-scatter measured: "
                f"{self.cost.latency_s * 1e6:.0f} us + {self.cost.bytes_per_s / 1e9:.2f} GB/s)")


def measure(group: dist.ProcessGroup, rank: int, by_all_reduce: bool, device: torch.device) -> ReductionCost:
    """Time the buckets' reduction at PROBE_ELEMENTS on `group` and fit latency and bandwidth.

    A collective: every rank of `group` must call it, and all get the same numbers (each
    size's slowest rank's median, so the choice made from them agrees everywhere).
    """
    size = group.size()
    medians = []
    for elements in PROBE_ELEMENTS:
        send = torch.ones(size, max(1, elements // size), dtype=torch.float32, device=device)  # (dp, S)
        _reduce(send, group, rank, by_all_reduce)  # untimed: a path's first use may set it up
        times = []
        for _ in range(ROUNDS):
            # Back to back after one barrier: the ranks leave a barrier up to ~100 us apart,
            # which a single timed call would count as latency; a run of calls keeps step.
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(CALLS_PER_ROUND):
                _reduce(send, group, rank, by_all_reduce)
            times.append((time.perf_counter() - start) / CALLS_PER_ROUND)
        medians.append(statistics.median(times))
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    (t_small, t_large), (b_small, b_large) = slowest.tolist(), (e * FP32 for e in PROBE_ELEMENTS)
    per_byte = (t_large - t_small) / (b_large - b_small)
    if per_byte <= 0:  # the large buffer cost no more than the small one: latency only
        return ReductionCost(latency_s=t_small, bytes_per_s=math.inf)
    return ReductionCost(latency_s=max(0.0, t_small - per_byte * b_small), bytes_per_s=1.0 / per_byte)


def _reduce(send: torch.Tensor, group: dist.ProcessGroup, rank: int, by_all_reduce: bool) -> None:
    work, recv = start_reduce_scatter(send, group, rank, by_all_reduce)
    if work is not None:
        work.wait()
    recv[0].item()  # the result is here (an accelerator's stream has finished)


def bucket_elements(cost: ReductionCost, n_elements: int, cap_elements: int) -> tuple[int, bool]:
    """B* = sqrt(N x latency x bandwidth) in elements, a power of two within the bounds; and
    whether the cap decided it."""
    best = math.sqrt(n_elements * FP32 * cost.latency_s * cost.bytes_per_s) / FP32  # inf: no bandwidth limit seen
    if math.isnan(best):  # no latency and no bandwidth limit: nothing to balance
        best = 0.0
    size = math.inf if math.isinf(best) else max(MIN_BUCKET_ELEMENTS, 2 ** int(math.log2(max(best, 1.0))))
    return (cap_elements, True) if size >= cap_elements else (size, False)


def choose_bucket_elements(group: dist.ProcessGroup, rank: int, by_all_reduce: bool, device: torch.device,
                           n_elements: int, cap_elements: int) -> BucketChoice:
    """The bucket size for `n_elements` of gradient reduced over `group` (a collective, see measure)."""
    cost = measure(group, rank, by_all_reduce, device)
    elements, capped = bucket_elements(cost, n_elements, cap_elements)
    return BucketChoice(cost, elements, capped)
