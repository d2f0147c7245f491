"""Tensor/sequence parallel settings that cannot work fail at start-up with one line naming the fix."""

from __future__ import annotations

import pytest

from polytrain.config import ConfigError, load_config
from polytrain.distributed.tensor_parallel.checks import valid_tp_degrees
from polytrain.distributed.topology import ParallelDims


def dims(world: int, *args: str) -> ParallelDims:
    return ParallelDims.from_config(load_config(None, ["--train.micro_batch_size", "4", *args]), world)


@pytest.mark.parametrize("world, args, message", [
    # The tiny preset: 6 heads, 2 KV heads, FFN 512.
    (4, ["--parallel.tp", "4"],
     "parallel.tp = 4 does not split model.n_heads = 6; tp values that fit this model: 1, 2"),
    (6, ["--parallel.tp", "3"],
     "parallel.tp = 3 does not split model.n_kv_heads = 2 (tp must divide it or be a multiple of it)"),
    (4, ["--parallel.tp", "4", "--model.n_heads", "8", "--model.ffn_dim", "510"],
     "parallel.tp = 4 does not split model.ffn_dim = 510; tp values that fit this model: 1, 2"),
    (2, ["--parallel.tp", "2", "--parallel.sp", "true", "--data.seq_len", "63"],
     "data.seq_len = 63 is not a multiple of 2; use data.seq_len = 62 or 64, or parallel.sp = false"),
    (4, ["--parallel.tp", "2", "--parallel.zero", "1"],
     "parallel.zero = 1 with parallel.tp = 2 is not supported yet"),
    (4, ["--parallel.tp", "2", "--parallel.zero", "2"], "use parallel.zero = 0 or 3"),
])
def test_tensor_parallel_misfits(world, args, message):
    with pytest.raises(ConfigError) as err:
        dims(world, *args)
    assert message in str(err.value)


def test_tp_may_exceed_kv_heads_when_it_is_a_multiple():
    d = dims(4, "--parallel.tp", "4", "--model.n_heads", "8", "--model.n_kv_heads", "2",
             "--parallel.sp", "true", "--parallel.zero", "3")
    assert (d.tp, d.sp, d.dp) == (4, True, 1)


def test_valid_tp_degrees_lists_every_fit():
    cfg = load_config(None, ["--model.n_heads", "12", "--model.n_kv_heads", "4", "--model.ffn_dim", "1536",
                             "--model.dim", "384"])
    # 3 and 6 divide the heads but neither divide nor are multiples of the 4 KV heads.
    assert valid_tp_degrees(cfg.model) == [1, 2, 4, 12]
