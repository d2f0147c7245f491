"""Batch-size ramp-up (Megatron's --rampup-batch-size): the sizes by consumed samples, and start-up checks."""

from __future__ import annotations

import pytest

from polytrain.config import load_config
from polytrain.errors import ConfigError
from polytrain.data.batch_schedule import BatchSchedule
from polytrain.train.startup import plan_layout


def test_sizes_by_consumed_samples():
    # 16 -> 64 by 16 over 300 samples: three increments, one every 100 samples.
    s = BatchSchedule(64, start=16, increment=16, ramp_samples=300)
    assert [s.at(c) for c in (0, 99, 100, 199, 200, 299, 300, 10**6)] == [16, 16, 32, 32, 48, 48, 64, 64]
    assert s.sizes() == [16, 32, 48, 64]
    assert BatchSchedule(64).at(5) == 64 and BatchSchedule(64).sizes() == [64]
    # Walking it: the steps a ramped run takes, each consuming its own size.
    consumed, steps = 0, []
    while consumed < 400:
        steps.append(s.at(consumed))
        consumed += steps[-1]
    assert steps == [16] * 7 + [32] * 3 + [48] * 2 + [64] * 2


@pytest.mark.parametrize("args, message", [
    (["--train.batch_rampup_start", "16"], "needs train.batch_rampup_increment > 0"),
    (["--train.batch_rampup_increment", "8"], "need train.batch_rampup_start > 0"),
    (["--train.batch_rampup_start", "64", "--train.batch_rampup_increment", "8",
      "--train.batch_rampup_samples", "100"], "must be below train.global_batch_size = 64"),
    (["--train.batch_rampup_start", "16", "--train.batch_rampup_increment", "20",
      "--train.batch_rampup_samples", "100"], "is not a multiple of train.batch_rampup_increment = 20"),
    (["--train.batch_rampup_start", "12", "--train.batch_rampup_increment", "4",
      "--train.batch_rampup_samples", "100"], "train.batch_rampup_start = 12 is not a multiple of "
                                              "train.micro_batch_size x dp = 8 x 1 = 8"),
])
def test_bad_ramp_ups_name_the_key(args, message):
    cfg = load_config(None, ["--train.global_batch_size", "64", *args])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        plan_layout(cfg, 1)  # the start-up check, which the command line runs before any worker


def test_ramp_up_checked_against_the_world_and_the_pipeline():
    ramp = ["--train.global_batch_size", "64", "--train.micro_batch_size", "4", "--train.batch_rampup_start",
            "16", "--train.batch_rampup_increment", "16", "--train.batch_rampup_samples", "300"]
    plan_layout(load_config(None, ramp), 4)
    with pytest.raises(ConfigError, match="not a multiple of train.micro_batch_size x dp = 4 x 8 = 32"):
        plan_layout(load_config(None, ramp), 8)
    pipeline = ramp + ["--parallel.pp", "2", "--model.n_layers", "4"]
    with pytest.raises(ConfigError, match="set parallel.pp_microbatches"):
        plan_layout(load_config(None, pipeline), 4)  # 16/(4x2) = 2 does not split runs of 8
    plan_layout(load_config(None, pipeline + ["--parallel.pp_microbatches", "2"]), 4)
