"""2D, 2.5D and 3D tensor parallelism against the single device, on spawned gloo ranks.

Layer level: every rank builds the same single-device Llama and a grid-parallel copy,
runs both on one batch and compares the loss and every parameter's gradient (gathered
from its grid blocks), and the peers the grid collectives used; a LayerNorm over a hidden
split along the grid row matches nn.LayerNorm; with bf16 states and train.matmul_fp32 the 2d
and 3d grids run no GEMM in bf16.
Training level: 10 steps of the trainer in each grid layout (2d alone and with dp = 2,
2.5d, 3d) follow the single-process loss and gradient-norm curve within 1e-4
relative, and a 2d checkpoint resumes on one process and back on a 2d grid.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from polytrain.config import ModelConfig
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, rows_after, train, train_rows
from tests.distributed.test_tp_training import copy_checkpoint
from tests.multirank import run_ranks, tp_parallelize

pytestmark = pytest.mark.slow
RTOL = 1e-4

# Small enough for 8 ranks on 2 cores; 3d at q = 2 needs every output width % 4 and B % 4.
BASE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
B, T = 8, 16


def _models(world_size: int, mode: str, depth: int, cfg: ModelConfig):
    """(single-device Llama, its grid-parallel copy, the grid's context): the same weights."""
    from polytrain.distributed.topology import ParallelDims
    from polytrain.models.common.init import init_plain
    from polytrain.models.llama.model import Llama

    ref = Llama(cfg)
    init_plain(ref, 0)
    dims = ParallelDims(world_size=world_size, dp_replicate=1, dp_shard=1, zero=0, tp=world_size,
                        tp_mode=mode, tp_depth=depth)
    model = copy.deepcopy(ref)
    ctx, _ = tp_parallelize(model, dims)
    return ref, model, ctx


def _compare(rank: int, world_size: int, mode: str, depth: int, overrides: dict) -> dict:
    """Loss and gradients of the grid model equal the single-device model's; returns the comm tally."""
    import torch.nn.functional as F

    from polytrain.distributed.collectives import comm_stats

    cfg = dataclasses.replace(BASE, **overrides)
    ref, model, ctx = _models(world_size, mode, depth, cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)

    ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    with comm_stats() as stats:
        loss = ctx.loss_fn(cfg.vocab_size)(model(tokens), targets)
        loss.backward()

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(ref_params), "parameter names must not change"
    local_elements = 0
    for name, param in model.named_parameters():
        local_elements += param.to_local().numel()
        torch.testing.assert_close(param.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=f"{mode}: gradient of {name}")
    full_elements = sum(p.numel() for p in ref.parameters())
    return {"stats": stats.as_dict(), "peers": sorted(stats.peers), "local_fraction": local_elements / full_elements}


def _cases(rank: int, world_size: int, cases: list) -> list[dict]:
    return [_compare(rank, world_size, *case) for case in cases]


def _bf16_products_in_fp32(rank: int, world_size: int, mode: str, depth: int) -> None:
    """train.matmul_fp32 on grid layers: no bf16 GEMM, and the single-device model's loss and gradients."""
    from tests.gemm_dtypes import assert_bf16_products_in_fp32

    ref, model, ctx = _models(world_size, mode, depth, BASE)
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, BASE.vocab_size, (B, T), generator=gen) for _ in range(2))
    assert_bf16_products_in_fp32(ref, model, ctx.loss_fn(BASE.vocab_size), tokens, targets, mode)


def _8_rank_checks(rank: int, world_size: int, cases: list) -> list[dict]:
    _bf16_products_in_fp32(rank, world_size, "3d", 1)
    return _cases(rank, world_size, cases)


def _layer_norm(rank: int, world_size: int) -> None:
    """A LayerNorm (mean and variance, gain and bias) over a hidden split along j of a 2 x 2 grid."""
    import torch.nn as nn

    from polytrain.distributed.tensor_parallel.grid import Grid
    from polytrain.distributed.tensor_parallel.grid_layers import GridNorm
    from polytrain.distributed.topology import ParallelDims

    dims = ParallelDims(world_size=4, dp_replicate=1, dp_shard=1, zero=0, tp=4, tp_mode="2d")
    grid = Grid(dims.tp_mesh(dims.build_mesh("cpu")), "2d", ("tp_i",), "tp_j")
    gen = torch.Generator().manual_seed(3)
    ref = nn.LayerNorm(8)
    with torch.no_grad():
        ref.weight.normal_(generator=gen)
        ref.bias.normal_(generator=gen)
    norm = GridNorm(copy.deepcopy(ref), grid, "tp_j", ("tp_i",))
    x, upstream = torch.randn(4, 3, 8, generator=gen, requires_grad=True), torch.randn(4, 3, 8, generator=gen)

    def block(t: torch.Tensor) -> torch.Tensor:  # (4, 3, 8) -> this rank's (2, 3, 4): sequences i, features j
        return t.chunk(2, 0)[grid.coord("tp_i")].chunk(2, -1)[grid.coord("tp_j")]

    (ref(x) * upstream).sum().backward()
    mine = block(x.detach()).requires_grad_()
    out = norm(mine)
    (out * block(upstream)).sum().backward()
    torch.testing.assert_close(out, block(ref(x).detach()))
    torch.testing.assert_close(mine.grad, block(x.grad))
    torch.testing.assert_close(norm.weight.grad.full_tensor(), ref.weight.grad)
    torch.testing.assert_close(norm.bias.grad.full_tensor(), ref.bias.grad)


def _2d_checks(rank: int, world_size: int, cases: list) -> list[dict]:
    _layer_norm(rank, world_size)
    _bf16_products_in_fp32(rank, world_size, "2d", 1)
    return _cases(rank, world_size, cases)


def test_2d_layers_match_single_device_and_talk_to_row_and_column_only():
    # GQA (2 KV heads on a 2 x 2 grid), then multi-head (4 KV heads) with a wider FFN.
    results = run_ranks(4, _2d_checks, [("2d", 1, {}), ("2d", 1, {"n_kv_heads": 4, "ffn_dim": 96})])
    for rank, (gqa, _) in enumerate(results):
        i, j = divmod(rank, 2)  # grid coordinates: tp_i outer, tp_j inner
        assert gqa["peers"] == sorted({i * 2 + (1 - j), (1 - i) * 2 + j}), "row and column peers only"
        # Every weight is split q^2 = 4 ways, norm gains q = 2 ways.
        assert gqa["local_fraction"] < 0.26
        assert set(gqa["stats"]) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_2p5d_and_3d_layers_match_single_device():
    results = run_ranks(8, _8_rank_checks, [("2.5d", 2, {}), ("3d", 1, {"n_kv_heads": 4})])
    for tesseract, cube in results:
        # 2.5d: one row peer, one column peer, one depth peer; 3d: one peer along each of 3 axes.
        assert len(tesseract["peers"]) == 3 and len(cube["peers"]) == 3
        assert cube["local_fraction"] < 0.2  # weights split q^3 = 8 ways


def _overrides(corpus, run_dir, *extra: str) -> list[str]:
    # 3d at q = 2 splits each micro-batch into q^2 = 4 blocks of whole sequences, and every
    # output width (dim, KV width, FFN, vocabulary) 4 ways; seq 16 keeps 8-rank runs short.
    return tiny_overrides(corpus, run_dir, data__seq_len=16, model__dim=32, model__ffn_dim=64,
                          train__micro_batch_size=4, train__global_batch_size=8, run__eval_batches=1,
                          checkpoint__every=4, checkpoint__keep=0) + list(extra)


def _grid_args(tp: int, mode: str, *extra: str) -> list[str]:
    return ["--parallel.tp", str(tp), "--parallel.tp_mode", mode, *extra]


def _train_all(rank: int, world_size: int, layouts: list[list[str]]) -> None:
    for args in layouts:
        train(args)


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    """The single-process run every grid layout must reproduce (its run directory)."""
    run_dir = tmp_path_factory.mktemp("ref")
    train(_overrides(small_corpus, run_dir))
    rows = train_rows(run_dir)
    assert len(rows) == 10 and rows[-1]["loss"] < rows[0]["loss"]
    return run_dir


def test_2d_matches_single_process_and_resumes_through_one_process_and_1d(reference, small_corpus, tmp_path):
    runs = {name: tmp_path / name for name in ("2d", "to_1", "to_2d", "to_1d")}
    run_ranks(4, _train_all, [_overrides(small_corpus, runs["2d"], *_grid_args(4, "2d"))])
    # 2d (step 4) -> one process (to step 10, saving at 8) -> 2d again; 2d (step 4) -> 1d tp 4.
    copy_checkpoint(runs["2d"], 4, runs["to_1"])
    train(_overrides(small_corpus, runs["to_1"]))
    copy_checkpoint(runs["to_1"], 8, runs["to_2d"])
    copy_checkpoint(runs["2d"], 4, runs["to_1d"])
    run_ranks(4, _train_all, [_overrides(small_corpus, runs["to_2d"], *_grid_args(4, "2d")),
                              _overrides(small_corpus, runs["to_1d"], *_grid_args(4, "1d"))])

    assert_same_trajectory(train_rows(reference), train_rows(runs["2d"]), RTOL, "2d")
    assert [r["step"] for r in train_rows(runs["to_1"])] == list(range(5, 11))
    assert_same_trajectory(rows_after(reference, 4), train_rows(runs["to_1"]), RTOL, "2d -> 1 process")
    assert_same_trajectory(rows_after(reference, 8), train_rows(runs["to_2d"]), RTOL, "1 process -> 2d")
    assert_same_trajectory(rows_after(reference, 4), train_rows(runs["to_1d"]), RTOL, "2d -> 1d")


GRIDS_8 = {
    "2d tp 4 x dp 2": _grid_args(4, "2d", "--parallel.dp", "2"),
    "2.5d q 2 d 2": _grid_args(8, "2.5d", "--parallel.tp_depth", "2"),
    "3d q 2": _grid_args(8, "3d"),
}


def test_8_rank_grids_match_single_process(reference, small_corpus, tmp_path):
    # One launch for the three layouts: 8 processes start once. Only the final checkpoint
    # is written (resharding is the test above's).
    runs = {name: tmp_path / name.replace(" ", "_") for name in GRIDS_8}
    run_ranks(8, _train_all, [_overrides(small_corpus, runs[name], *grid, "--checkpoint.every", "0")
                              for name, grid in GRIDS_8.items()])
    for name in GRIDS_8:
        assert_same_trajectory(train_rows(reference), train_rows(runs[name]), RTOL, name)
