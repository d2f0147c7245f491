"""Tensor/sequence parallel training reproduces the single-process run, and resumes across tp layouts.

One reference run (1 process, 10 steps); the layouts below must give the same loss and
gradient-norm trajectory within 1e-4 relative. The tp=2 run saves a checkpoint at step 4
which a single process resumes (saving at step 8), which tp=4 resumes in turn: the loss
curve continues unchanged through tp 2 -> 1 -> 4. Every run ends by sampling text with
the KV cache, which must be the reference's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, rows_after, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-4


def overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    # seq_len 32 keeps the runs short; every tp here divides it (sequence parallelism).
    return tiny_overrides(corpus, run_dir, data__seq_len=32, checkpoint__every=4, checkpoint__keep=0,
                          run__sample_tokens=8) + list(extra)


def _samples(rank: int, world_size: int, layouts: list[list[str]]) -> list[str]:
    """Train each layout in turn; the text each generated at the end (KV-cached, tensor-parallel)."""
    return [train(args)["sample"] for args in layouts]


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    """Start `dst_run` with only `src_run`'s checkpoint of `step`, so it resumes there."""
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / f"step_{step}", dst_run / "checkpoints" / f"step_{step}")


def test_tp_layouts_match_single_process_and_resume_across_tp(small_corpus, tmp_path):
    runs = {name: tmp_path / name for name in
            ("ref", "tp2", "tp2_sp_selective", "to_tp1", "tp4_sp", "tp2dp2_sp_zero3", "tp2dp2_full", "to_tp4")}
    ref_sample = train(overrides(small_corpus, runs["ref"]))["sample"]
    reference = train_rows(runs["ref"])
    assert len(reference) == 10 and reference[-1]["loss"] < reference[0]["loss"]

    tp = ["--parallel.tp"]
    samples = run_ranks(2, _samples, [
        overrides(small_corpus, runs["tp2"], *tp, "2"),
        overrides(small_corpus, runs["tp2_sp_selective"], *tp, "2", "--parallel.sp", "true",
                  "--train.activation_checkpoint", "selective"),
    ])
    copy_checkpoint(runs["tp2"], 4, runs["to_tp1"])
    samples.append([train(overrides(small_corpus, runs["to_tp1"]))["sample"]])
    copy_checkpoint(runs["to_tp1"], 8, runs["to_tp4"])
    samples += run_ranks(4, _samples, [
        overrides(small_corpus, runs["tp4_sp"], *tp, "4", "--parallel.sp", "true"),
        overrides(small_corpus, runs["tp2dp2_sp_zero3"], *tp, "2", "--parallel.sp", "true", "--parallel.zero", "3"),
        overrides(small_corpus, runs["tp2dp2_full"], *tp, "2", "--train.activation_checkpoint", "full"),
        overrides(small_corpus, runs["to_tp4"], *tp, "4"),
    ])

    # Every rank of every layout samples the single-process run's text (same seed, same logits).
    assert all(sample == ref_sample for rank in samples for sample in rank), (ref_sample, samples)
    for name in ("tp2", "tp2_sp_selective", "tp4_sp", "tp2dp2_sp_zero3", "tp2dp2_full"):
        assert_same_trajectory(reference, train_rows(runs[name]), RTOL, name)
    # tp 2 -> 1 -> 4: each resumed run continues the reference curve from its checkpoint.
    assert [r["step"] for r in train_rows(runs["to_tp1"])] == list(range(5, 11))
    assert_same_trajectory(rows_after(runs["ref"], 4), train_rows(runs["to_tp1"]), RTOL, "tp2 -> tp1")
    assert_same_trajectory(rows_after(runs["ref"], 8), train_rows(runs["to_tp4"]), RTOL, "tp1 -> tp4")
