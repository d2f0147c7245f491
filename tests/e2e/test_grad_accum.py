"""bf16 model states over 32 accumulation steps follow fp32 (train.grad_accum_dtype = "fp32", the default).

Every 16-bit path that sums gradients over micro-batches: one rank (the fp32 sum is the
gradient shard), ZeRO-2 over 2 ranks (fp32 shards), and a 2-stage pipeline with tied
embeddings at ZeRO-1 (one rank per stage: the tied copies' fp32 sums are added across the
stages) and at ZeRO-2 with offload (the tied copies wait in a device fp32 sum reduced at the
step). Each run is compared with the fp32 single process, the same 64 sequences a step:
losses and gradient norms within 1%. Measured: losses within 5e-5, gradient norms within
0.17% (the precision itself, on one Linear, is tests/unit/test_grad_accum_precision.py's).
"""

from __future__ import annotations

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
BF16 = ["--train.precision", "bf16"]


def _run(corpus, run_dir, micro_batch_size: int = 2, *extra: str) -> list[str]:
    """2 steps of 64 sequences (32 micro-batches a rank), tied embeddings, short sequences."""
    return tiny_overrides(corpus, run_dir, run__steps=2, data__seq_len=32, model__tie_embeddings=True,
                          train__micro_batch_size=micro_batch_size, train__global_batch_size=64) + list(extra)


def _train_all(rank: int, world_size: int, runs: list[list[str]]) -> None:
    for overrides in runs:
        train(overrides)


def test_bf16_with_32_accumulation_steps_follows_fp32(small_corpus, tmp_path):
    train(_run(small_corpus, tmp_path / "fp32"))
    train(_run(small_corpus, tmp_path / "bf16", 2, *BF16))
    layouts = {
        "zero2_dp2": _run(small_corpus, tmp_path / "zero2_dp2", 1, *BF16, "--parallel.zero", "2"),
        "zero1_pp2": _run(small_corpus, tmp_path / "zero1_pp2", 2, *BF16, "--parallel.zero", "1",
                          "--parallel.pp", "2"),
        "zero2_pp2_offload": _run(small_corpus, tmp_path / "zero2_pp2_offload", 2, *BF16, "--parallel.zero", "2",
                                  "--parallel.pp", "2", "--parallel.offload", "cpu"),
    }
    run_ranks(2, _train_all, list(layouts.values()))
    fp32 = train_rows(tmp_path / "fp32")
    assert len(fp32) == 2
    for name in ("bf16", *layouts):
        assert_same_trajectory(fp32, train_rows(tmp_path / name), 1e-2, f"bf16 {name} against fp32")
