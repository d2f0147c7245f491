"""Ways of doing one operation, timed in alternating rounds in one process.

Shared by the host kernel benchmarks (host_activations.py, host_cross_entropy.py,
host_flash_attention.py): each round runs every way once, the order reversed every other round,
so drift in the machine's speed hits all alike; a cell reports the median and the spread.
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections.abc import Callable

import torch


def alternate(ways: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """{name: the milliseconds `ways[name]()` reported in each round}."""
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(ways[name]())
    return times


def cell(times: list[float], digits: int = 2) -> str:
    """'median (min-max)'."""
    return f"{statistics.median(times):.{digits}f} ({min(times):.{digits}f}-{max(times):.{digits}f})"


def speedup(slow: list[float], fast: list[float]) -> str:
    """The ratio of the medians, as '1.23x'."""
    return f"{statistics.median(slow) / statistics.median(fast):.2f}x"


def host_against_torch(step: Callable[[bool], tuple], rounds: int, digits: int = 2) -> str:
    """'torch cell | host cell | speedup | largest difference' for `step(host)` -> (ms, *results): a run
    on the host operators (True) or torch's ops (False); the difference is over every result."""
    results = {host: step(host)[1:] for host in (True, False)}  # also a warm-up of each
    times = alternate({way: (lambda host=host: step(host)[0]) for way, host in (("host", True), ("torch", False))},
                      rounds)
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results[True], results[False]))
    return (f"{cell(times['torch'], digits)} | {cell(times['host'], digits)} | "
            f"{speedup(times['torch'], times['host'])} | {diff:.1e}")


def require_host_kernels() -> None:
    from polytrain.backend import host_matmul

    if not host_matmul.available():
        raise SystemExit("error: the host kernels could not be built here (see the warning above)")


def machine_line(load_at_start: float, rounds: int, what: str) -> str:
    """The line above a table: date, threads, torch, the load average around the run, what a cell is."""
    return (f"\n{datetime.date.today()}, {torch.get_num_threads()} threads, torch {torch.__version__}, load average "
            f"{load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at the end; {what}, median (spread) of "
            f"{rounds} alternating rounds\n")
