"""Context parallelism on one process: the zigzag layout, the start-up checks, the byte formulas."""

from __future__ import annotations

import pytest
import torch

from polytrain.distributed.context_parallel.checks import check_context_parallel, cp_degrees
from polytrain.distributed.context_parallel.cost import attention_bytes
from polytrain.distributed.context_parallel.layout import Layout
from polytrain.errors import ConfigError


def test_zigzag_slots_and_round_trip():
    ring = Layout(16, ring=4, ulysses=1)
    assert [ring.slots(r).tolist() for r in range(4)] == [[0, 1, 14, 15], [2, 3, 12, 13],
                                                          [4, 5, 10, 11], [6, 7, 8, 9]]
    hybrid = Layout(16, ring=2, ulysses=2)  # ring rank 0 holds chunks 0 and 3, split over 2 ranks
    assert [hybrid.slots(c).tolist() for c in range(4)] == [[0, 1, 2, 3], [12, 13, 14, 15],
                                                            [4, 5, 6, 7], [8, 9, 10, 11]]
    assert Layout(16, ring=1, ulysses=4).slots(1).tolist() == [4, 5, 6, 7]
    x = torch.arange(2 * 16).view(2, 16)
    for layout in (ring, hybrid):
        parts = torch.cat([layout.shard(x, c) for c in range(4)], dim=1)
        assert torch.equal(layout.unshard(parts), x)


def test_zigzag_balances_causal_work():
    """Visible (query, key) pairs per rank: equal under zigzag, 7x apart for contiguous shards."""
    def work(slots):  # a query at slot s sees s + 1 keys
        return int((slots + 1).sum())

    zigzag = Layout(64, ring=4, ulysses=1)
    assert len({work(zigzag.slots(r)) for r in range(4)}) == 1
    contiguous = [work(torch.arange(r * 16, (r + 1) * 16)) for r in range(4)]
    assert contiguous[-1] / contiguous[0] > 6


@pytest.mark.parametrize("args, message", [
    ((4, "ring", 1, 1001, 8, 8), "data.seq_len = 1001 is not a multiple of 2 x parallel.cp = 8 .*use 1000 or 1008"),
    ((4, "ring", 1, 1004, 8, 8), "use 1000 or 1008"),
    ((4, "ulysses", 1, 1002, 8, 8), "multiple of parallel.cp = 4 .*use 1000 or 1004"),
    ((4, "ulysses", 1, 1024, 6, 6), "parallel.cp = 4 must divide the 6 attention heads; choose one of 2, 3, 6"),
    ((4, "ulysses", 1, 1024, 8, 8, 4), "2 attention heads per tensor-parallel rank"),
    ((8, "ulysses", 1, 1024, 24, 3), "3 key/value heads: one must divide the other.*choose one of 3, 6, 12, 24"),
    ((6, "hybrid", 4, 1024, 8, 8), "parallel.cp_ulysses = 4 must divide parallel.cp = 6 .*; choose one of 1, 2, 3, 6"),
    ((8, "hybrid", 4, 1020, 8, 8), "not a multiple of 8 .*2 x 2 zigzag chunks.*use 1016 or 1024"),
    ((4, "hybrid", 4, 1024, 6, 6), "parallel.cp_ulysses = 4 must divide the 6 .* or parallel.cp_mode = 'ring'"),
    ((2, "stripes", 1, 1024, 8, 8), "parallel.cp_mode = 'stripes' is not one of ulysses, ring, hybrid"),
    ((2, "ring", 1, 1028, 8, 8, 4, True), "multiple of parallel.cp x parallel.tp = 2 x 4 .*use 1024 or 1032"),
])
def test_bad_input_is_one_line_with_the_nearest_valid_values(args, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_context_parallel(*args)
    assert "\n" not in str(err.value)


def test_valid_input_passes():
    check_context_parallel(4, "ring", 1, 1024, 8, 2)
    check_context_parallel(8, "ulysses", 1, 1024, 8, 2)  # 2 KV heads repeated on 4 ranks each
    check_context_parallel(8, "hybrid", 2, 1024, 6, 6)  # 8 > 6 heads: Ulysses 2 x ring 4
    assert cp_degrees(8, "hybrid", 2) == (4, 2)


def test_byte_formulas_are_wave2s():
    b, s, n, n_kv, d, e = 2, 4096, 16, 4, 64, 2
    for P in (2, 4):
        fwd, bwd = attention_bytes(b, s, n, n_kv, d, ring=1, ulysses=P, elem_bytes=e)
        assert fwd == bwd == pytest.approx((2 * b * s * n * d + 2 * b * s * n_kv * d) * (P - 1) / P**2 * e)
        fwd, bwd = attention_bytes(b, s, n, n_kv, d, ring=P, ulysses=1, elem_bytes=e)
        assert fwd == pytest.approx(2 * b * s * n_kv * d * (P - 1) / P * e)
        assert bwd == pytest.approx(fwd * (e + 4) / e)  # K/V again, plus their fp32 gradient


def test_ring_steps_skip_half_of_every_foreign_shard():
    """Under the zigzag layout a causal ring step computes half of a foreign shard's tiles, the
    same number on every rank, so no rank waits for another."""
    from polytrain.models.common.blockwise_attention import Visibility

    layout, chunk = Layout(64, ring=4, ulysses=1), 8
    computed = []
    for j in range(4):
        counts = []
        for src in range(4):
            tiles = Visibility(True, layout.ring_slots(j), layout.ring_slots(src)).tiles(chunk, chunk)
            counts.append(sum(tiles.verdict(a, b) != "skip" for a in range(2) for b in range(2)))
        computed.append(counts)
    for j, counts in enumerate(computed):
        assert counts[j] == 3  # its own shard: two diagonal tiles and the early chunk for the late one
        assert all(c == 2 for src, c in enumerate(counts) if src != j)  # 2 of 4 tiles


@pytest.mark.parametrize("args, message", [
    (["--parallel.cp", "4", "--data.seq_len", "100"],
     "data.seq_len = 100 is not a multiple of 2 x parallel.cp = 8 .*use 96 or 104"),
    (["--parallel.cp", "4", "--parallel.cp_mode", "ulysses", "--model.n_heads", "6", "--model.n_kv_heads", "6"],
     "parallel.cp = 4 must divide the 6 attention heads; choose one of 2, 3, 6"),
    (["--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "3"],
     "parallel.cp_ulysses = 3 must divide parallel.cp = 4"),
    (["--parallel.cp", "2", "--parallel.cp_ulysses", "2"], "cp_ulysses = 2 only applies with parallel.cp_mode = 'hybrid'"),
    (["--parallel.cp", "2", "--model.dropout", "0.1"], "model.dropout = 0.1 with parallel.cp > 1"),
    (["--parallel.cp", "2", "--model.arch", "bert"], "parallel.cp > 1 runs decoders"),
    (["--data.packed_documents", "true", "--parallel.pp", "2"], "packed_documents = true with parallel.pp > 1"),
    (["--parallel.cp", "3"], "world size 4 is not divisible by parallel.cp x parallel.tp x parallel.pp = 3 x 1 x 1"),
])
def test_start_up_refuses_bad_context_parallel_configs_in_one_line(args, message):
    from polytrain.config import load_config
    from polytrain.train.startup import plan_layout

    with pytest.raises(ConfigError, match=message) as err:
        plan_layout(load_config(None, ["--data.seq_len", "64", "--model.max_seq_len", "128", *args]), 4)
    assert "\n" not in str(err.value)
