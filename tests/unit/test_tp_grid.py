"""2D / 2.5D / 3D tensor-parallel grids: their shapes, and the settings that cannot work failing at
start-up with the valid choices near the request."""

from __future__ import annotations

import pytest

from polytrain.config import ConfigError, load_config
from polytrain.distributed.tensor_parallel.grid import grid_axes, grid_side, grid_sizes
from polytrain.distributed.topology import ParallelDims


def dims(world: int, *args: str) -> ParallelDims:
    return ParallelDims.from_config(load_config(None, ["--train.micro_batch_size", "4", *args]), world)


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


@pytest.mark.parametrize("world, args, message", [
    # The tiny preset: dim 192, 6 heads, 2 KV heads, FFN 512, vocabulary 4096.
    (6, ["--parallel.tp", "6", "--parallel.tp_mode", "2d"],
     "parallel.tp = 6 is not a q x q grid (tp_mode '2d'); nearest valid 2d sizes: 4, 9"),
    (2, ["--parallel.tp", "2", "--parallel.tp_mode", "2d"], "nearest valid 2d sizes: 4"),
    (4, ["--parallel.tp", "4", "--parallel.tp_mode", "3d"],
     "parallel.tp = 4 is not a q x q x q grid (tp_mode '3d'); nearest valid 3d sizes: 8"),
    (8, ["--parallel.tp", "8", "--parallel.tp_mode", "2.5d", "--parallel.tp_depth", "3"],
     "parallel.tp = 8 is not a q x q x tp_depth (3) grid (tp_mode '2.5d'); nearest valid 2.5d sizes: 3, 12"),
    (9, ["--parallel.tp", "9", "--parallel.tp_mode", "2d"],
     "tp_mode '2d' at parallel.tp = 9 (q = 3) does not split model.n_kv_heads = 2 and model.n_kv_heads x "
     "head_dim = 64 and model.ffn_dim = 512 and model.vocab_size = 4096; tp values of 2d that fit this model: 4"),
    (27, ["--parallel.tp", "27", "--parallel.tp_mode", "3d", "--model.n_kv_heads", "6"],
     "tp_mode '3d' at parallel.tp = 27 (q = 3) does not split"),
    (8, ["--parallel.tp", "8", "--parallel.tp_mode", "3d", "--model.vocab_size", "4094"],
     "does not split model.vocab_size = 4094; tp values of 3d that fit this model: none"),
    (8, ["--parallel.tp", "8", "--parallel.tp_mode", "3d", "--train.micro_batch_size", "2",
         "--train.global_batch_size", "8"],
     "train.micro_batch_size = 2 is not a multiple of 4; use 4"),
    (4, ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.sp", "true"],
     "parallel.sp with parallel.tp_mode = '2d' must be false"),
    (8, ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.pp", "2"],
     "parallel.pp with parallel.tp_mode = '2d' must be 1"),
    (8, ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--parallel.zero", "3"],
     "parallel.zero with parallel.tp_mode = '2d' must be 0"),
    (4, ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--model.tie_embeddings", "true"],
     "model.tie_embeddings with parallel.tp_mode = '2d' must be false"),
    (16, ["--parallel.tp", "8", "--parallel.tp_mode", "3d"],
     "parallel.dp with parallel.tp_mode = '3d' must be 1 (or tp_mode '2d')"),
])
def test_grid_misfits(world, args, message):
    with pytest.raises(ConfigError) as err:
        dims(world, *args)
    assert message in str(err.value)


def test_grids_that_fit_pass():
    assert dims(8, "--parallel.tp", "8", "--parallel.tp_mode", "3d").tp_mode == "3d"
    assert dims(8, "--parallel.tp", "8", "--parallel.tp_mode", "2.5d", "--parallel.tp_depth", "2").tp_depth == 2
