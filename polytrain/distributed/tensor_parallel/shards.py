"""How a dimension of `total` rows splits over `n` ranks: torch.chunk's (and DTensor Shard's) rule."""

from __future__ import annotations

import math


def shard_range(total: int, n: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s part of `total` rows split like torch.chunk / DTensor Shard.

    Parts are ceil(total / n) rows, the last ones smaller or empty: e.g. a vocabulary of
    10 over 4 ranks is 3, 3, 3, 1. Uneven parts keep the global shape, and so the
    checkpoint, the same as on one device (no padding rows).
    """
    chunk = math.ceil(total / n)
    start = min(rank * chunk, total)
    return start, min(start + chunk, total)


def shard_sizes(total: int, n: int) -> list[int]:
    """Rows each of `n` ranks holds (see shard_range)."""
    return [end - start for start, end in (shard_range(total, n, r) for r in range(n))]
