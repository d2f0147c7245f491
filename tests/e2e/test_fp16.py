"""fp16 with dynamic loss scaling in the trainer: an overflow skips the step and halves the scale."""

from __future__ import annotations

import math
import shutil

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


def test_fp16_trains_at_the_default_preset_and_corpus(tmp_path):
    """The default model (4096-token vocabulary) on the default corpus (the stdlib's code, with
    its runs of one indentation token): fp16 follows fp32. 256-token steps keep it cheap and
    still overflowed 4 of 30 steps with the chunked loss's former fixed 2**10 gradient scale."""
    def run(precision):
        run_dir = tmp_path / precision
        train(["--train.precision", precision, "--run.steps", "30", "--run.log_every", "1",
               "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
               "--run.eval_batches", "1", "--run.sample_tokens", "0", "--run.out_dir", str(run_dir)])
        return train_rows(run_dir)

    fp32, fp16 = run("fp32"), run("fp16")
    assert len(fp16) == 30 and fp16[-1]["skipped_steps"] <= 2
    assert fp16[-1]["loss"] == pytest.approx(fp32[-1]["loss"], rel=0.02)


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


def _cosine_lr(k: int, lr=3e-3, min_lr=3e-4, warmup=4, total=10) -> float:
    """The default schedule's rate for optimizer update k (0-based), written out independently."""
    if k < warmup:
        return lr * (k + 1) / warmup
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, (k - warmup) / (total - warmup))))


def test_skipped_steps_hold_the_lr_schedule_also_across_a_resume(small_corpus, tmp_path):
    """An overflowing step counts as a step (a batch consumed, DeepSpeed's global_steps) but
    neither the lr schedule nor the optimizer's step count advances, before and after a resume."""
    def run(run_dir):
        # 2^20 with 16-bit gradients: the first 3 steps overflow, then the scale fits.
        return tiny_overrides(small_corpus, run_dir, run__steps=10, train__precision="fp16",
                              train__initial_scale_power=20, train__hysteresis=1, train__warmup_steps=4,
                              checkpoint__every=5, checkpoint__keep=0)

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(run(straight))
    rows = train_rows(straight)
    applied = [r for r in rows if r["grad_norm"] is not None]
    skipped_before_5 = sum(r["grad_norm"] is None for r in rows[:5])
    assert 0 < skipped_before_5 < 5, "the step-5 checkpoint must hold skipped and applied steps"
    assert [r["lr"] for r in applied] == pytest.approx([_cosine_lr(k) for k in range(len(applied))], rel=1e-12)
    assert [r["optimizer_steps"] for r in rows] == [r["step"] - r["skipped_steps"] for r in rows]
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_5", resumed / "checkpoints" / "step_5")
    train(run(resumed))
    for a, b in zip(rows[5:], train_rows(resumed), strict=True):
        for key in ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped_steps", "optimizer_steps"):
            assert b[key] == (None if a[key] is None else pytest.approx(a[key], rel=1e-6)), (key, a["step"])
