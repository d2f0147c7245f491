"""The shape of a tensor-parallel grid (2D, 2.5D, 3D) and its mesh axis names.

    mode   grid (mesh axes, outermost first)        tp
    2d     tp_i x tp_j            q x q               q^2
    2.5d   tp_k x tp_i x tp_j     d x q x q           q^2 d
    3d     tp_j x tp_l x tp_i     q x q x q           q^3

Pure arithmetic, shared by the mesh (topology.py) and the grid layers (tensor_parallel/grid.py).
"""

from __future__ import annotations

import math


def grid_axes(mode: str, tp: int, depth: int = 1) -> dict[str, int]:
    """Mesh axis name -> size of the tp grid of `mode` (outermost first); {"tp": tp} for 1d.

    The 3D axis order (j, l, i) is what lets a DTensor say "rows split by j, then each
    block split again by i": placements shard a tensor dim in mesh-axis order.
    """
    if mode == "1d":
        return {"tp": tp}
    q = grid_side(mode, tp, depth)
    if q is None:
        raise ValueError(f"tp = {tp} (depth {depth}) is not a {mode} grid")
    return {"2d": {"tp_i": q, "tp_j": q}, "2.5d": {"tp_k": depth, "tp_i": q, "tp_j": q},
            "3d": {"tp_j": q, "tp_l": q, "tp_i": q}}[mode]


def grid_side(mode: str, tp: int, depth: int = 1) -> int | None:
    """q of the grid (tp = q^2, q^2 d or q^3), or None when tp is not such a number."""
    if mode == "2.5d":
        if tp % depth:
            return None
        tp //= depth
    power = 3 if mode == "3d" else 2
    q = round(tp ** (1 / power))
    return q if q ** power == tp else None


def grid_sizes(mode: str, depth: int, limit: int) -> list[int]:
    """Every tp of `mode` up to `limit` (q = 1, 2, ...), e.g. 2d: 1, 4, 9, 16."""
    power = 3 if mode == "3d" else 2
    scale = depth if mode == "2.5d" else 1
    return [q ** power * scale for q in range(1, math.isqrt(limit) + 2) if q ** power * scale <= limit]
