"""fp16 with dynamic loss scaling in the trainer: an overflow skips the step and halves the scale."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import read_rows, train, train_rows
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow


def test_fp16_trains_close_to_fp32(small_corpus, tmp_path):
    train(tiny_overrides(small_corpus, tmp_path / "fp32", run__steps=8))
    train(tiny_overrides(small_corpus, tmp_path / "fp16", run__steps=8, train__precision="fp16"))
    fp32, fp16 = train_rows(tmp_path / "fp32"), train_rows(tmp_path / "fp16")
    assert all(r["skipped_steps"] == 0 for r in fp16)  # 2**16 is a safe start for this model
    assert all(r["loss_scale"] == 2.0**16 for r in fp16)
    for a, b in zip(fp32, fp16):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-2)
    assert fp16[-1]["loss"] < fp16[0]["loss"]


def _train(rank, world_size, overrides):
    train(overrides)


def test_overflow_skips_the_step_and_halves_the_scale(small_corpus, tmp_path):
    """A scale of 2**22 overflows fp16 gradients: those steps are skipped (on both ranks) until it fits."""
    overrides = tiny_overrides(small_corpus, tmp_path, run__steps=14, train__precision="fp16",
                               train__initial_scale_power=22, train__hysteresis=1) + ["--parallel.zero", "2"]
    run_ranks(2, _train, overrides)
    rows = train_rows(tmp_path)
    skipped = [r for r in rows if r["grad_norm"] is None]
    assert skipped, "a 2**22 loss scale must overflow"
    scales = [r["loss_scale"] for r in rows]
    for before, after, row in zip(scales, scales[1:], rows):
        if row["grad_norm"] is None:
            assert after == before / 2  # hysteresis 1: every overflow halves
        else:
            assert after == before
    assert rows[-1]["skipped_steps"] == len(skipped)
    applied = [r for r in rows if r["grad_norm"] is not None]
    assert applied and applied[-1]["loss"] < rows[0]["loss"]
    assert all(r.get("val_loss") is None or r["val_loss"] > 0 for r in read_rows(tmp_path))
