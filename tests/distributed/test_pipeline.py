"""Pipeline parallelism reproduces the single-process run.

Same seed, data and global batch, fp32: every schedule, with data parallelism and
ZeRO-3, activation checkpointing, an uneven split and several pipeline runs per
step gives the single process's losses, gradient norms and validation losses. A
checkpoint written at pp=2 resumes on one process, whose checkpoint resumes at
pp=4, on the same curve. With tied embeddings (the last stage's copy of the token
table, see polytrain/distributed/pipeline/tied.py) 1f1b and pp=2 x dp=2 ZeRO-3
match the tied single process, and tied checkpoints move from pp=2 to one process
and from one process to ZB-V (where one rank holds both copies).

Runs of one world size share their spawned processes (layouts run one after the
other), which keeps this file to about three minutes on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tests.conftest import tiny_overrides
from tests.distributed.test_parity import (
    _train_layouts,
    assert_same_trajectory,
    read_rows,
    rows_after,
    train,
    train_rows,
)
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow
RTOL = 1e-4
# Four blocks, so pp=2 with two stages per rank (interleaved, ZB-V) and pp=4 have a block per stage.
MODEL = dict(model__n_layers=4, run__eval_every=5)

TWO_RANKS = {
    "gpipe": dict(parallel__pp_schedule="gpipe"),
    "1f1b": dict(checkpoint__every=4, checkpoint__keep=0),  # also the first leg of the resume chain
    "interleaved_selective_recompute": dict(parallel__pp_schedule="interleaved",
                                            train__activation_checkpoint="selective"),
    "zero_bubble_full_recompute": dict(parallel__pp_schedule="zero_bubble", train__activation_checkpoint="full"),
    "uneven_split_two_runs_per_step": dict(parallel__pp_split="layers.3", parallel__pp_microbatches=2),
    "tied_1f1b": dict(model__tie_embeddings=True, checkpoint__every=4, checkpoint__keep=0),
}
FOUR_RANKS = {
    "pp4": dict(parallel__pp=4),
    "pp2_dp2_zero0": dict(),
    "pp2_dp2_zero3_zero_bubble": dict(parallel__zero=3, parallel__pp_schedule="zero_bubble"),
    "tied_pp2_dp2_zero3": dict(model__tie_embeddings=True, parallel__zero=3),
}
TIED = dict(model__tie_embeddings=True)


def reference_of(name: str) -> str:
    """The single-process run a layout must reproduce: the tied model's for tied layouts."""
    return "reference_tied" if name.startswith("tied_") else "reference"


def overrides(corpus: Path, run_dir: Path, **extra) -> list[str]:
    return tiny_overrides(corpus, run_dir, **{"parallel__pp": 2, **MODEL, **extra})


def val_rows(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in read_rows(run_dir) if "val_loss" in r]


def assert_same_val(ref: list[tuple[int, float]], got: list[tuple[int, float]], what: str) -> None:
    assert [s for s, _ in got] == [s for s, _ in ref], what
    for (step, a), (_, b) in zip(ref, got):
        assert b == pytest.approx(a, rel=RTOL), f"{what}: val_loss at step {step}"


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> Path:
    """Every run of this file, in dependency order; returns the directory holding them by name."""
    root = tmp_path_factory.mktemp("pipeline")
    train(tiny_overrides(small_corpus, root / "reference", **MODEL))
    train(tiny_overrides(small_corpus, root / "reference_tied", checkpoint__every=4, checkpoint__keep=0,
                         **MODEL, **TIED))
    two = [overrides(small_corpus, root / name, **extra) for name, extra in TWO_RANKS.items()]
    two.append(overrides(small_corpus, root / "resumed_tied_zero_bubble", parallel__pp_schedule="zero_bubble",
                         checkpoint__resume=root / "reference_tied" / "checkpoints" / "step_4", **TIED))
    run_ranks(2, _train_layouts, two)
    # Resume chain: pp=2's step-4 checkpoint -> one process to step 10 (saving step 7) -> pp=4 from step 7.
    train(tiny_overrides(small_corpus, root / "resumed_single", checkpoint__every=7, checkpoint__keep=0,
                         checkpoint__resume=root / "1f1b" / "checkpoints" / "step_4", **MODEL))
    four = [overrides(small_corpus, root / name, **extra) for name, extra in FOUR_RANKS.items()]
    four.append(overrides(small_corpus, root / "resumed_pp4", parallel__pp=4,
                          checkpoint__resume=root / "resumed_single" / "checkpoints" / "step_7"))
    run_ranks(4, _train_layouts, four)
    train(tiny_overrides(small_corpus, root / "resumed_tied_single", **MODEL, **TIED,
                         checkpoint__resume=root / "tied_1f1b" / "checkpoints" / "step_4"))
    return root


@pytest.mark.parametrize("reference", ["reference", "reference_tied"])
def test_reference_learns(runs, reference):
    rows = train_rows(runs / reference)
    assert len(rows) == 10 and rows[-1]["loss"] < rows[0]["loss"]
    assert [s for s, _ in val_rows(runs / reference)] == [0, 5, 10]


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_layout_matches_single_process(runs, name):
    ref = runs / reference_of(name)
    assert_same_trajectory(train_rows(ref), train_rows(runs / name), RTOL, name)
    assert_same_val(val_rows(ref), val_rows(runs / name), name)


def test_checkpoint_moves_from_pp2_to_one_process_to_pp4(runs):
    ref = runs / "reference"
    single, pp4 = runs / "resumed_single", runs / "resumed_pp4"
    assert [r["step"] for r in train_rows(single)] == list(range(5, 11))
    assert_same_trajectory(rows_after(ref, 4), train_rows(single), RTOL, "pp=2 -> 1 process")
    assert [r["step"] for r in train_rows(pp4)] == [8, 9, 10]
    assert_same_trajectory(rows_after(ref, 7), train_rows(pp4), RTOL, "1 process -> pp=4")
    assert_same_val(val_rows(ref)[-1:], val_rows(pp4), "1 process -> pp=4")
    trainer_state = json.loads((pp4 / "checkpoints" / "step_10" / "trainer.json").read_text())
    assert trainer_state["world_size"] == 4 and trainer_state["step"] == 10


def test_tied_checkpoint_moves_between_pp2_and_one_process(runs):
    ref = runs / "reference_tied"
    # The copy leaves no trace: the pp=2 checkpoint holds exactly the single process's keys.
    assert checkpoint_keys(runs / "tied_1f1b" / "checkpoints" / "step_4") == checkpoint_keys(
        ref / "checkpoints" / "step_4")
    for name, what in (("resumed_tied_single", "tied pp=2 -> 1 process"),
                       ("resumed_tied_zero_bubble", "tied 1 process -> pp=2 ZB-V")):
        assert [r["step"] for r in train_rows(runs / name)] == list(range(5, 11)), what
        assert_same_trajectory(rows_after(ref, 4), train_rows(runs / name), RTOL, what)
        assert_same_val(val_rows(ref)[1:], val_rows(runs / name), what)


def checkpoint_keys(path: Path) -> list[str]:
    """The tensor and state keys a DCP checkpoint holds ("model.output.weight", "optim.state....")."""
    return sorted(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
