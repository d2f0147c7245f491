"""2D / 2.5D / 3D tensor-parallel grids: their shapes and mesh axes (misfits: test_tp_checks.py)."""

from __future__ import annotations

from polytrain.distributed.grid_shape import grid_axes, grid_side, grid_sizes
from tests.unit.test_tp_checks import dims


def test_grid_shapes():
    assert grid_axes("1d", 4) == {"tp": 4}
    assert grid_axes("2d", 9) == {"tp_i": 3, "tp_j": 3}
    assert grid_axes("2.5d", 8, 2) == {"tp_k": 2, "tp_i": 2, "tp_j": 2}
    assert grid_axes("3d", 27) == {"tp_j": 3, "tp_l": 3, "tp_i": 3}
    assert [grid_side("2d", n) for n in (4, 6, 16)] == [2, None, 4]
    assert [grid_side("2.5d", n, 2) for n in (8, 18, 4, 9)] == [2, 3, None, None]
    assert grid_side("3d", 64) == 4 and grid_side("3d", 16) is None
    assert grid_sizes("2d", 1, 20) == [1, 4, 9, 16] and grid_sizes("2.5d", 3, 50) == [3, 12, 27, 48]


def test_grid_replaces_the_tp_axis_of_the_mesh_with_the_same_ranks():
    d = dims(8, "--parallel.tp", "4", "--parallel.tp_mode", "2d")
    assert (d.dp, d.tp, d.tp_mode) == (2, 4, "2d")
    assert d.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the grid's ranks: consecutive, as in 1d
    assert d.tp_axes == {"tp_i": 2, "tp_j": 2}
    # Without tensor parallelism a grid mode has no grid: the plain tp axis of size 1.
    assert dims(2, "--parallel.tp_mode", "2.5d", "--parallel.tp_depth", "2").tp_axes == {"tp": 1}


def test_grids_that_fit_pass():
    assert dims(8, "--parallel.tp", "8", "--parallel.tp_mode", "3d").tp_mode == "3d"
    assert dims(8, "--parallel.tp", "8", "--parallel.tp_mode", "2.5d", "--parallel.tp_depth", "2").tp_depth == 2
