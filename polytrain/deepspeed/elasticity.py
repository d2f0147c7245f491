"""DeepSpeed's `elasticity` block (version 0.1): a global batch many world sizes can keep.

    "elasticity": {"enabled": true, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
                   "min_gpus": 1, "max_gpus": 10000, "prefer_larger_batch": true, "version": 0.1}

DeepSpeed's rule (removed from DeepSpeed 0.19, kept here so such configs still run): each
listed micro-batch, and their least common multiple, is scaled by the largest highly
composite number that keeps it within max_train_batch_size; of those candidate batches the
one that the most world sizes in [min_gpus, max_gpus] can keep wins (ties: the larger, or
the smaller without prefer_larger_batch). A world size keeps batch B when B / world is a
multiple of a listed micro-batch. At a given world size the micro-batch is the largest
listed one that divides B / world.

polytrain runs it as parallel.elastic with that global batch, so a job restarted at another
valid world size keeps it; a world size outside the valid list is refused at start-up, as
DeepSpeed refuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polytrain.errors import ConfigError

_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def highly_composite_numbers(limit: int) -> list[int]:
    """Every n <= limit with more divisors than any smaller number, ascending.

    Such n are products of the first primes with non-increasing exponents, so only those
    are enumerated (a few thousand below a million), then kept where the divisor count
    sets a record.
    """
    found: list[tuple[int, int]] = []  # (n, divisor count)

    def walk(index: int, n: int, divisors: int, cap: int) -> None:
        found.append((n, divisors))
        if index == len(_PRIMES):
            return
        p, power = _PRIMES[index], 1
        for exponent in range(1, cap + 1):
            power *= p
            if n * power > limit:
                break
            walk(index + 1, n * power, divisors * (exponent + 1), exponent)

    walk(0, 1, 1, 64)
    out, best = [], 0
    for n, divisors in sorted(found):
        if divisors > best:
            out.append(n)
            best = divisors
    return out


@dataclass(frozen=True)
class ElasticBatch:
    """DeepSpeed's choice: the global batch and every world size in range that keeps it."""

    global_batch_size: int
    world_sizes: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]

    def micro_batch_at(self, world: int) -> int:
        """The largest listed micro-batch dividing the batch's share of one of `world` ranks."""
        if world not in self.world_sizes:
            raise ConfigError(f"world size {world} cannot keep the elastic global batch {self.global_batch_size} "
                              f"(elasticity.micro_batch_sizes {list(self.micro_batch_sizes)}); valid world sizes: "
                              f"{', '.join(map(str, self.world_sizes))}")
        share = self.global_batch_size // world
        return max(m for m in self.micro_batch_sizes if share % m == 0)


def _keeping_worlds(batch: int, micro: list[int], low: int, high: int) -> list[int]:
    """World sizes in [low, high] at which `batch` splits into whole listed micro-batches per rank."""
    worlds = set()
    for m in micro:
        if batch % m == 0:
            n = batch // m
            worlds.update(d for d in range(1, n + 1) if n % d == 0 and low <= d <= high)
    return sorted(worlds)


def elastic_batch(micro: list[int], max_batch: int, min_gpus: int = 1, max_gpus: int | None = None,
                  prefer_larger: bool = True) -> ElasticBatch:
    """DeepSpeed elasticity 0.1's batch for these micro-batches (see the module docstring)."""
    if not micro or any(m < 1 or m > max_batch for m in micro):
        raise ConfigError(f"elasticity.micro_batch_sizes = {micro} must be positive and at most "
                          f"elasticity.max_train_batch_size = {max_batch}")
    max_gpus = max_gpus or max_batch // min(micro)
    hcn = highly_composite_numbers(max_batch)
    bases = [*micro, math.lcm(*micro)]
    candidates = sorted({max(b * h for h in hcn if b * h <= max_batch) for b in bases})
    best_batch, best_worlds = min(micro), []
    for batch in candidates:
        worlds = _keeping_worlds(batch, micro, min_gpus, max_gpus)
        better = len(worlds) > len(best_worlds) or (len(worlds) == len(best_worlds) and (
            batch > best_batch if prefer_larger else batch < best_batch))
        if better:
            best_batch, best_worlds = batch, worlds
    if not best_worlds:
        raise ConfigError(f"no world size in elasticity.min_gpus..max_gpus = {min_gpus}..{max_gpus} keeps any "
                          f"batch of elasticity.micro_batch_sizes {micro} up to {max_batch}; widen the range")
    return ElasticBatch(best_batch, tuple(best_worlds), tuple(sorted(set(micro))))
