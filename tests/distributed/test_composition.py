"""Tensor x pipeline x data parallelism composed on one mesh reproduces the single-process run.

Four ranks, fp32, 10 steps, same seed and data. (tp 2, pp 2) with and without sequence
parallelism and with the interleaved schedule must give the single process's loss and
gradient-norm trajectory within 1e-4 relative. Layout change on resume: the (tp 2, pp 2)
run's step-4 checkpoint continues on one process (saving at step 7), which continues at
tp 4: the same loss curve throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import (
    _train_layouts,
    assert_same_trajectory,
    rows_after,
    train,
    train_rows,
)
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-4
# Four blocks: two chunks of one block per rank for the interleaved schedule at pp 2.
BASE = dict(model__n_layers=4, data__seq_len=32)
LAYOUTS = {
    "tp2_pp2": dict(parallel__tp=2, parallel__pp=2, checkpoint__every=4, checkpoint__keep=0),
    "tp2_pp2_sp_interleaved": dict(parallel__tp=2, parallel__pp=2, parallel__sp=True,
                                   parallel__pp_schedule="interleaved"),
}


def overrides(corpus: Path, run_dir: Path, **extra) -> list[str]:
    return tiny_overrides(corpus, run_dir, **{**BASE, **extra})


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("composition")
    train(overrides(small_corpus, root / "reference"))
    run_ranks(4, _train_layouts, [overrides(small_corpus, root / name, **extra) for name, extra in LAYOUTS.items()])
    train(overrides(small_corpus, root / "resumed_single", checkpoint__every=7, checkpoint__keep=0,
                    checkpoint__resume=root / "tp2_pp2" / "checkpoints" / "step_4"))
    run_ranks(4, _train_layouts, [overrides(small_corpus, root / "resumed_tp4", parallel__tp=4,
                                            checkpoint__resume=root / "resumed_single" / "checkpoints" / "step_7")])
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tp_x_pp_matches_single_process(runs, name):
    reference = train_rows(runs / "reference")
    assert len(reference) == 10 and reference[-1]["loss"] < reference[0]["loss"]
    assert_same_trajectory(reference, train_rows(runs / name), RTOL, name)


def test_checkpoint_moves_from_tp2_pp2_to_one_process_to_tp4(runs):
    ref = runs / "reference"
    assert [r["step"] for r in train_rows(runs / "resumed_single")] == list(range(5, 11))
    assert_same_trajectory(rows_after(ref, 4), train_rows(runs / "resumed_single"), RTOL, "(tp2, pp2) -> 1 process")
    assert [r["step"] for r in train_rows(runs / "resumed_tp4")] == [8, 9, 10]
    assert_same_trajectory(rows_after(ref, 7), train_rows(runs / "resumed_tp4"), RTOL, "1 process -> tp 4")
