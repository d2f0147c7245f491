"""ParallelDims: degrees checked against the world size; batch and shard divisibility."""

from __future__ import annotations

import pytest

from polytrain.config import ConfigError, load_config
from polytrain.distributed.topology import ParallelDims


def dims(world: int, *args: str) -> ParallelDims:
    return ParallelDims.from_config(load_config(None, ["--train.micro_batch_size", "4", *args]), world)


def test_dp_defaults_to_the_whole_world():
    d = dims(4)
    assert (d.dp, d.dp_replicate, d.dp_shard) == (4, 4, 1)


def test_zero3_shards_over_all_dp_or_a_group():
    assert dims(4, "--parallel.zero", "3").shape == (1, 4)
    assert dims(4, "--parallel.zero", "3", "--parallel.zero_shard", "2").shape == (2, 2)


@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero12_shards_over_all_dp(stage):
    d = dims(4, "--parallel.zero", stage)
    assert d.shape == (1, 4) and d.zero == int(stage)


def test_grad_accumulation_fills_the_global_batch():
    cfg = load_config(None, ["--train.global_batch_size", "32", "--train.micro_batch_size", "4"])
    assert ParallelDims.from_config(cfg, 2).grad_accum_steps(cfg) == 4


@pytest.mark.parametrize("world, args, message", [
    (4, ["--parallel.dp", "2"], "parallel.dp = 2 does not fit world size 4"),
    (3, [], "train.global_batch_size = 16 is not a multiple of train.micro_batch_size x dp = 4 x 3 = 12; set it to 12 or 24"),
    (4, ["--parallel.zero", "3", "--parallel.zero_shard", "3"], "parallel.zero_shard = 3 must divide parallel.dp = 4; choose one of 1, 2, 4"),
    (2, ["--parallel.zero_shard", "2"], "only applies with parallel.zero = 3"),
    (2, ["--parallel.dp", "0"], "must be positive or -1"),
])
def test_inconsistent_degrees(world, args, message):
    with pytest.raises(ConfigError) as err:
        dims(world, *args)
    assert message in str(err.value)
