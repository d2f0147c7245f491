"""Tensor/sequence parallel settings that cannot work fail at start-up with one line naming the fix."""

from __future__ import annotations

import pytest

from polytrain.config import load_config
from polytrain.distributed.tensor_parallel.checks import valid_tp_degrees
from polytrain.distributed.topology import ParallelDims
from polytrain.errors import ConfigError
from polytrain.train.startup import plan_layout


def dims(world: int, *args: str) -> ParallelDims:
    return plan_layout(load_config(None, ["--train.micro_batch_size", "4", *args]), world).dims


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
    # tp_mode 2d / 2.5d / 3d grids: the valid choices near the request.
    # The tiny preset: dim 192, 6 heads, 2 KV heads, FFN 512, vocabulary 4096.
    (6, ["--parallel.tp", "6", "--parallel.tp_mode", "2d"],
     "parallel.tp = 6 is not a q x q grid (tp_mode '2d'); nearest valid 2d sizes: 4, 9"),
    (2, ["--parallel.tp", "2", "--parallel.tp_mode", "2d"], "nearest valid 2d sizes: 4"),
    (4, ["--parallel.tp", "4", "--parallel.tp_mode", "3d"],
     "parallel.tp = 4 is not a q x q x q grid (tp_mode '3d'); nearest valid 3d sizes: 8"),
    (8, ["--parallel.tp", "8", "--parallel.tp_mode", "2.5d", "--parallel.tp_depth", "3"],
     "parallel.tp = 8 is not a q x q x tp_depth (3) grid (tp_mode '2.5d'); nearest valid 2.5d sizes: 3, 12"),
    (9, ["--parallel.tp", "9", "--parallel.tp_mode", "2d"],
     ("tp_mode '2d' at parallel.tp = 9 (q = 3) does not split model.n_kv_heads = 2 and model.n_kv_heads x "
      "head_dim = 64 and model.ffn_dim = 512 and model.vocab_size = 4096; tp values of 2d that fit this model: 4")),
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
    (4, ["--parallel.tp", "4", "--parallel.tp_mode", "2d", "--model.arch", "gpt2"],
     "parallel.tp_mode = '2d' has layers for model.arch = 'llama' only; model.arch = 'gpt2' runs with "
     "parallel.tp_mode = '1d'"),
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
