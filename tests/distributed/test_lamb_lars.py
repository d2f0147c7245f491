"""LAMB and LARS under sharding: trust ratios from whole-tensor norms, parameters as on one device.

1. The optimizer alone over DTensors on a mesh of 2 ranks (sharded along dim 0 or dim 1, or
   replicated) and of 2 x 2 ranks (sharded over both mesh dimensions, one or none), against
   the same optimizer on the full tensors: equal, while the same steps with each rank's
   local norms are not (so the check can tell them apart); and one all-reduce per sharding
   mesh dimension and step for all tensors. The 2 x 2 mesh is the one test with 4 ranks:
   FSDP2 over tensor-parallel shards puts weights on such a mesh.
2. Training, 5 steps at world size 2 with ZeRO 1, 2 (also with nvme offload), 3 and with
   tp = 2 (sequence parallel on): the final parameters equal the single-process run's
   within 1e-6; and a single process resumed from ZeRO-2's step-3 checkpoint ends there too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, rows_after, train, train_rows
from tests.distributed.test_tp_training import copy_checkpoint
from tests.distributed.test_zero12 import final_weights
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
# LAMB at the paper's eps 1e-6: at 1e-8, Adam's m / sqrt(v) of elements whose gradient is
# near 1e-8 turns the layouts' fp32 summation-order noise into 3e-6 differences in the
# (not adapted, Adam-stepped) norm gains after 5 steps under tp 2, as large as AdamW's own.
OPTIMIZERS = {"lamb": ["--train.optimizer", "lamb", "--train.eps", "1e-6"],
              "lars": ["--train.optimizer", "lars", "--train.lr", "0.02"]}
# zero2 also saves at step 3 (its state as Shard(0) DTensors), from which one process resumes;
# zero2_nvme keeps the masters and LAMB/LARS state in memory-mapped files.
LAYOUTS = {"zero1": ["--parallel.zero", "1"],
           "zero2": ["--parallel.zero", "2", "--checkpoint.every", "3", "--checkpoint.keep", "0"],
           "zero2_nvme": ["--parallel.zero", "2", "--parallel.offload", "nvme"],
           "zero3": ["--parallel.zero", "3"], "tp2_sp": ["--parallel.tp", "2", "--parallel.sp", "true"]}


def _full_tensors() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Five weights and 3 steps of gradients; rows and columns of very different scales,
    so a shard's norm is far from its share of the whole's."""
    # float64, so that summation order (shards vs whole) stays far below what is checked.
    gen, f64 = torch.Generator().manual_seed(3), torch.float64
    scale = torch.logspace(-2, 1, 8, dtype=f64).unsqueeze(1)  # (8, 1)
    w = [torch.randn(8, 6, generator=gen, dtype=f64) * scale, torch.randn(6, 8, generator=gen, dtype=f64) * scale.T,
         torch.randn(4, 4, generator=gen, dtype=f64), torch.randn(8, 4, generator=gen, dtype=f64) * scale,
         torch.randn(8, 4, generator=gen, dtype=f64) * scale]
    g = [[torch.randn(x.shape, generator=gen, dtype=f64) * (1 + i) for i, x in enumerate(w)] for _ in range(3)]
    return w, g


# Per mesh shape, the placements of the five weights: sharded along either dim, replicated,
# and on the 2 x 2 mesh sharded over both dimensions, one, the other, or neither; the last
# as FSDP2 lays out a tensor-parallel Shard(0) weight (a _StridedShard is not is_shard()).
PLACEMENTS = {
    (2,): [[Shard(0)], [Shard(1)], [Replicate()], [Shard(0)], [Shard(1)]],
    (2, 2): [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Replicate()], [Replicate(), Shard(0)],
             [_StridedShard(0, split_factor=2), Shard(0)]],
}


def _step_sharded(rank: int, world_size: int, name: str, shape: tuple[int, ...]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from polytrain.optim import trust
    from polytrain.optim.lamb import Lamb
    from polytrain.optim.lars import Lars

    mesh = init_device_mesh("cpu", shape)
    placements = PLACEMENTS[shape]
    make = {"lamb": lambda ps, **kw: Lamb(ps, lr=0.05, weight_decay=0.1, **kw),
            "lars": lambda ps, **kw: Lars(ps, lr=0.05, weight_decay=0.1, **kw)}[name]
    full, grads = _full_tensors()

    def run(sharded: bool, **kw) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, p) if sharded else w.clone())
                  for w, p in zip(full, placements)]
        opt = make(params, **kw)
        for step_grads in grads:
            for p, g, pl in zip(params, step_grads, placements):
                p.grad = distribute_tensor(g.clone(), mesh, pl) if sharded else g.clone()
            opt.step()
        return [p.detach().full_tensor() if sharded else p.detach() for p in params]

    calls = []
    all_reduce = trust.dist.all_reduce
    trust.dist.all_reduce = lambda *a, **k: (calls.append(1), all_reduce(*a, **k))[1]
    try:
        whole = run(True)
    finally:
        trust.dist.all_reduce = all_reduce
    reference, local = run(False), run(True, square_sums=lambda tensors, local: local)
    # Plain numbers back: tensors would travel as shared memory the exiting rank frees.
    return {"whole_error": [(a - b).abs().max().item() for a, b in zip(whole, reference)],
            "local_error": [(a - b).abs().max().item() for a, b in zip(local, reference)],
            "all_reduces": len(calls)}


@pytest.mark.parametrize("name", ["lamb", "lars"])
@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["1d", "2d"])
def test_ratio_uses_the_whole_tensor_norm(name, shape):
    sharded = [any(not p.is_replicate() for p in pl) for pl in PLACEMENTS[shape]]
    for out in run_ranks(math.prod(shape), _step_sharded, name, shape):
        # Per step one all-reduce per mesh dimension that shards something, for all tensors.
        assert out["all_reduces"] == 3 * len(shape), out
        assert max(out["whole_error"]) < 1e-12, out
        # Local norms give other ratios, so other weights (not for replicated tensors).
        assert min(e for e, s in zip(out["local_error"], sharded) if s) > 1e-3, out


def _train_all(rank: int, world_size: int, runs: list[list[str]]) -> None:
    for overrides in runs:
        train(overrides)


def _args(corpus: Path, run_dir: Path, optimizer: str, *extra: str) -> list[str]:
    # seq_len 32: divisible by tp for sequence parallelism, and short.
    return tiny_overrides(corpus, run_dir, data__seq_len=32, run__steps=5) + OPTIMIZERS[optimizer] + list(extra)


def test_sharded_training_matches_one_device(small_corpus, tmp_path):
    runs = {(opt, layout): _args(small_corpus, tmp_path / f"{opt}_{layout}", opt, *extra)
            for opt in OPTIMIZERS for layout, extra in LAYOUTS.items()}
    for opt in OPTIMIZERS:
        train(_args(small_corpus, tmp_path / f"{opt}_ref", opt))
    run_ranks(2, _train_all, list(runs.values()))
    for opt in OPTIMIZERS:  # ZeRO-2 at 2 ranks -> 1 process, from step 3 to 5
        copy_checkpoint(tmp_path / f"{opt}_zero2", 3, tmp_path / f"{opt}_resumed")
        train(_args(small_corpus, tmp_path / f"{opt}_resumed", opt))
        runs[opt, "resumed"] = None
    for opt, layout in runs:
        _assert_same_run(tmp_path / f"{opt}_ref", tmp_path / f"{opt}_{layout}", f"{opt} with {layout}",
                         after=3 if layout == "resumed" else 0)


def test_fsdp_over_tensor_parallel_matches_one_device(small_corpus, tmp_path):
    # dp 2 x tp 2 with ZeRO-3: FSDP2 shards the tp shards again, so weights sit on a 2-D mesh.
    train(_args(small_corpus, tmp_path / "ref", "lamb"))
    run_ranks(4, _train_all, [_args(small_corpus, tmp_path / "dp2_tp2", "lamb", "--parallel.tp", "2",
                                    "--parallel.zero", "3")])
    _assert_same_run(tmp_path / "ref", tmp_path / "dp2_tp2", "lamb with dp 2 x tp 2, ZeRO-3")


def _assert_same_run(ref_dir: Path, run_dir: Path, what: str, after: int = 0) -> None:
    """The loss trajectory (after step `after`) within 1e-5 relative; every final weight within 1e-6."""
    assert_same_trajectory(rows_after(ref_dir, after), train_rows(run_dir), 1e-5, what)
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    assert ref.keys() == got.keys()
    for key in ref:
        error = (got[key] - ref[key]).abs().max().item()
        assert error <= 1e-6, f"{what}: {key} differs by {error:.2e}"
