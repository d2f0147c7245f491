"""Single-process features: activation checkpointing, bf16, prepared token files, checkpoint pruning."""

from __future__ import annotations

import json
import re

import pytest

from polytrain.cli import main
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, read_rows, train, train_rows


@pytest.fixture(scope="module")
def plain_run(small_corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("plain")
    train(tiny_overrides(small_corpus, run_dir, run__steps=6))
    return train_rows(run_dir)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_memory_not_math(small_corpus, tmp_path, plain_run, mode):
    train(tiny_overrides(small_corpus, tmp_path, run__steps=6, train__activation_checkpoint=mode))
    assert_same_trajectory(plain_run, train_rows(tmp_path), 1e-6, f"{mode} activation checkpointing")


def test_bf16_trains_close_to_fp32(small_corpus, tmp_path, plain_run):
    train(tiny_overrides(small_corpus, tmp_path, run__steps=6, train__precision="bf16"))
    rows = train_rows(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"]
    for a, b in zip(plain_run, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
    # bf16 really ran in lower precision: the trajectories are close but not equal.
    assert any(a["grad_norm"] != b["grad_norm"] for a, b in zip(plain_run, rows))


def test_prepared_bin_as_source(small_corpus, tmp_path, capsys):
    out = tmp_path / "data" / "small.bin"
    assert main(["prepare", str(small_corpus), str(out), "--vocab-size", "512"]) == 0
    assert "tokens" in capsys.readouterr().out
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta and out.is_file() and out.with_suffix(".val.bin").is_file()
    summary = train(tiny_overrides(small_corpus, tmp_path / "run", run__steps=3) + ["--data.source", str(out)])
    assert summary["step"] == 3 and summary["val_loss"] < summary["first_val_loss"]


def test_prepare_rejects_a_bad_output_path(small_corpus, tmp_path, capsys):
    assert main(["prepare", str(small_corpus), str(tmp_path / "x.txt")]) == 2
    assert "must be a file name ending in .bin" in capsys.readouterr().err


def test_keep_prunes_old_checkpoints_and_logs_every_row(small_corpus, tmp_path, capsys):
    train(tiny_overrides(small_corpus, tmp_path, run__steps=6, checkpoint__every=2, checkpoint__keep=2,
                         run__eval_every=3))
    # The start-up line names the peak MFU is against and where it comes from.
    assert re.search(r"^MFU against [0-9.]+ TFLOP/s fp32 \(measured on this CPU, best of \d+ runs?, ",
                     capsys.readouterr().out, re.MULTILINE)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_6"]
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 6]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "mem_gb", "time"):
        assert key in rows[1]
    assert rows[1]["tokens"] == 8 * 64
    assert all(0 < r["mfu"] <= 1 for r in rows if "mfu" in r)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[train]" in (tmp_path / "config.toml").read_text()
