"""Batch size as a schedule: a ramp-up takes the sizes of its samples, and a run resumed at another
global batch continues at the exact sample the checkpoint left off."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, train, train_rows

pytestmark = pytest.mark.slow


def test_ramp_up_equals_constant_batches_resumed_at_each_size(small_corpus, tmp_path, capsys):
    """Ramp 2 -> 8 by 2 over 24 samples runs steps of 2, 2, 2, 2, 4, 4 sequences. The same steps
    run as a constant batch of 2 for 4 steps, then resumed from its checkpoint at a constant batch
    of 4: the same samples in the same order, so the same losses. (The lr is a function of the step
    and of run.steps, which the shorter run has fewer of: min_lr = lr makes it flat after warmup.)"""
    flat = {"train__min_lr": 3e-3}
    ramp = tiny_overrides(small_corpus, tmp_path / "ramp", run__steps=6, train__global_batch_size=8,
                          train__batch_rampup_start=2, train__batch_rampup_increment=2,
                          train__batch_rampup_samples=24, **flat)
    train(ramp)
    ramped = train_rows(tmp_path / "ramp")
    assert [r["global_batch"] for r in ramped] == [2, 2, 2, 2, 4, 4]

    train(tiny_overrides(small_corpus, tmp_path / "two", run__steps=4, train__global_batch_size=2,
                         checkpoint__every=4, **flat))
    assert_same_trajectory(ramped[:4], train_rows(tmp_path / "two"), 1e-6, "constant batch of 2")

    resumed = tmp_path / "four"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    capsys.readouterr()
    train(tiny_overrides(small_corpus, resumed, run__steps=6, train__global_batch_size=4, **flat))
    assert "the checkpoint's global batch was 2, now 4: the data continues at sample 8" in capsys.readouterr().out
    assert_same_trajectory(ramped[4:], train_rows(resumed), 1e-6, "resumed at a batch of 4")
    state = json.loads((resumed / "checkpoints" / "step_6" / "trainer.json").read_text())
    assert state["sampler"]["consumed"] == 8 + 2 * 4
