"""ParallelDims: degrees checked against the world size; batch and shard divisibility."""

from __future__ import annotations

import pytest

from polytrain.config import load_config
from polytrain.distributed.topology import ParallelDims
from polytrain.errors import ConfigError
from polytrain.train.startup import plan_layout


def dims(world: int, *args: str) -> ParallelDims:
    return plan_layout(load_config(None, ["--train.micro_batch_size", "4", *args]), world).dims


def test_dp_defaults_to_the_whole_world():
    d = dims(4)
    assert (d.dp, d.dp_replicate, d.dp_shard) == (4, 4, 1)


def test_zero3_shards_over_all_dp_or_a_group():
    assert dims(4, "--parallel.zero", "3").shape == (1, 1, 4, 1, 1)
    assert dims(4, "--parallel.zero", "3", "--parallel.zero_shard", "2").shape == (1, 2, 2, 1, 1)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero12_shards_over_all_dp(stage):
    d = dims(4, "--parallel.zero", stage)
    assert d.shape == (1, 1, 4, 1, 1) and d.zero == int(stage)


def test_grad_accumulation_fills_the_global_batch():
    cfg = load_config(None, ["--train.global_batch_size", "32", "--train.micro_batch_size", "4"])
    assert plan_layout(cfg, 2).batch.accum_steps == 4


@pytest.mark.parametrize("world, args, message", [
    (4, ["--parallel.dp", "2"], "parallel.dp = 2 does not fit world size 4"),
    (3, [], "train.global_batch_size = 16 is not a multiple of train.micro_batch_size x dp = 4 x 3 = 12; set it to 12 or 24"),
    (4, ["--parallel.zero", "3", "--parallel.zero_shard", "3"], "parallel.zero_shard = 3 must divide parallel.dp = 4; choose one of 1, 2, 4"),
    (2, ["--parallel.zero_shard", "2"], "only applies with parallel.zero = 3"),
    (2, ["--parallel.dp", "0"], "must be positive or -1"),
    (6, ["--parallel.tp", "4"], "world size 6 is not divisible by parallel.tp x parallel.pp = 4 x 1"),
    (4, ["--parallel.tp", "2", "--parallel.dp", "4"], "parallel.dp = 4 does not fit world size 4"),
    (2, ["--parallel.sp", "true"], "it needs parallel.tp > 1"),
    (4, ["--parallel.tp", "4", "--parallel.tp_depth", "2"], "parallel.tp_depth only applies with parallel.tp_mode = '2.5d'"),
    (2, ["--parallel.pp", "0"], "parallel.pp = 0 must be at least 1"),
])
def test_inconsistent_degrees(world, args, message):
    with pytest.raises(ConfigError) as err:
        dims(world, *args)
    assert message in str(err.value)


def test_model_parallel_degrees_leave_the_rest_to_dp():
    d = dims(8, "--parallel.tp", "2", "--parallel.pp", "2")
    assert (d.dp, d.tp, d.pp, d.shape) == (2, 2, 2, (2, 2, 1, 1, 2))


def test_tp_overlap_is_on_by_default_and_off_under_the_zero_bubble_schedule():
    assert dims(4, "--parallel.tp", "2").tp_overlap
    assert not dims(4, "--parallel.tp", "2", "--parallel.tp_overlap", "false").tp_overlap
    # That schedule computes input and weight gradients in separate passes itself.
    zero_bubble = ("--parallel.pp", "2", "--parallel.pp_schedule", "zero_bubble")
    assert not dims(4, "--parallel.tp", "2", *zero_bubble).tp_overlap
    assert dims(4, "--parallel.tp", "2", "--parallel.pp", "2").tp_overlap


def test_two_nodes_of_four_tp_stays_inside_a_node_and_dp_spans_nodes():
    # Ranks 0-3 are node 0, 4-7 node 1 (torchrun numbers ranks node by node).
    d = dims(8, "--parallel.tp", "2")
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp_replicate") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.coordinates(5) == {"pp": 0, "dp_replicate": 2, "dp_shard": 0, "cp": 0, "tp": 1}


def test_two_nodes_of_four_pipeline_stages_go_across_nodes():
    d = dims(8, "--parallel.tp", "2", "--parallel.pp", "2")
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups("dp_replicate") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [d.coordinates(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_coordinates_match_the_device_mesh_layout():
    import torch
    d = dims(8, "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero", "3")
    layout = torch.arange(8).reshape(d.shape)
    for rank in range(8):
        c = d.coordinates(rank)
        assert layout[c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"]].item() == rank


def test_context_parallel_sits_inside_data_parallel_and_outside_tp():
    """cp groups are consecutive tp groups: ranks that talk every layer stay close."""
    d = dims(8, "--parallel.tp", "2", "--parallel.cp", "2")
    assert (d.dp, d.cp, d.tp, d.grad_ranks) == (2, 2, 2, 4)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ConfigError, match="parallel.cp x parallel.tp x parallel.pp = 4 x 2 x 1"):
        dims(6, "--parallel.tp", "2", "--parallel.cp", "4")
