"""ZeRO-1/2 layout arithmetic: shards follow torch.chunk (= DTensor Shard(0)); buckets respect their size."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from polytrain.distributed.zero import join_pieces, plan_buckets, shard_rows, split_into_pieces


@pytest.mark.parametrize("d0", [1, 3, 5, 8, 13])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_shard_rows_are_torch_chunk(d0, dp):
    chunks = torch.arange(d0).chunk(dp)
    for rank in range(dp):
        start, rows = shard_rows(d0, dp, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, start + rows)) == expected


@pytest.mark.parametrize("shape, dp", [((5, 3), 4), ((7,), 2), ((2, 5), 4), ((8, 2), 4)])
def test_pieces_round_trip_and_padding_is_zeroed(shape, dp):
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32)
    per = -(-shape[0] // dp) * (full.numel() // shape[0])  # ceil(d0 / dp) rows
    pieces = torch.full((dp, per), float("nan"))  # (dp, piece); uninitialised memory may hold anything
    split_into_pieces(full, pieces)
    for rank in range(dp):
        start, rows = shard_rows(shape[0], dp, rank)
        row = full.numel() // shape[0]
        own = pieces[rank, : rows * row]
        assert torch.equal(own, full[start * row:(start + rows) * row])
        assert not pieces[rank, rows * row:].any()  # padding is zeroed
    back = torch.empty_like(full)
    join_pieces(pieces, back)
    assert torch.equal(back, full)


def test_buckets_hold_at_most_their_bytes_and_big_parameters_alone():
    params = [("a", nn.Parameter(torch.zeros(10, 4))), ("b", nn.Parameter(torch.zeros(6))),
              ("c", nn.Parameter(torch.zeros(100))), ("d", nn.Parameter(torch.zeros(3, 3)))]
    buckets = plan_buckets(params, bucket_bytes=200, dp=4, rank=3)  # 50 fp32 values
    assert [[s.fqn for s in b.slots] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    a, b = buckets[0].slots
    # a: 10 rows of 4 -> 3 rows a piece (rank 3 owns row 9 only); b: 6 rows -> 2 a piece, rank 3 none.
    assert (a.offset, a.piece, a.rows, b.offset, b.piece, b.rows) == (0, 12, 1, 12, 2, 0)
    assert buckets[0].size == 14 and buckets[0].master.shape == buckets[0].grad.shape == (14,)


def test_scalar_parameters_are_refused():
    with pytest.raises(ValueError, match="parameter s is a scalar"):
        plan_buckets([("s", nn.Parameter(torch.zeros(())))], bucket_bytes=100, dp=2, rank=0)
