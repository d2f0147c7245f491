"""Bad input gives one clear line on stderr and a non-zero exit, and loses nothing saved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.cli import main
from tests.conftest import tiny_overrides


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_data_path(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--data.source", str(tmp_path / "nope.txt"))
    assert_one_line_error(code, err, "nope.txt", "does not exist")


def test_unknown_architecture(capsys):
    code, err = run_cli(capsys, "train", "--model.arch", "lama")
    assert_one_line_error(code, err, "model.arch", "did you mean 'llama'")


def test_unknown_key_suggests_the_closest(capsys):
    code, err = run_cli(capsys, "train", "--train.lrr", "1e-3")
    assert_one_line_error(code, err, "train.lrr", "did you mean 'train.lr'")


def test_world_size_that_degrees_do_not_divide(capsys):
    code, err = run_cli(capsys, "train", "--parallel.nproc", "3", "--parallel.dp", "2")
    assert_one_line_error(code, err, "parallel.dp = 2", "world size 3")


def test_batch_not_divisible_by_world(capsys):
    code, err = run_cli(capsys, "train", "--parallel.nproc", "3")
    assert_one_line_error(code, err, "train.global_batch_size = 16", "8 x 3 = 24", "set it to 24")


def test_foreign_checkpoint_directory(capsys, tmp_path):
    foreign = tmp_path / "not_a_checkpoint"
    foreign.mkdir()
    (foreign / "weights.pt").write_bytes(b"\0" * 16)
    code, err = run_cli(capsys, "train", "--checkpoint.resume", str(foreign), "--run.steps", "1")
    assert_one_line_error(code, err, "is not a polytrain checkpoint")


@pytest.fixture(scope="module")
def trained_run(small_corpus, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("run")
    overrides = tiny_overrides(small_corpus, run_dir, run__steps=4, checkpoint__every=2)
    assert main(["train", *overrides]) == 0
    return run_dir


def test_truncated_checkpoint(capsys, small_corpus, trained_run, tmp_path):
    damaged = tmp_path / "step_4"
    import shutil

    shutil.copytree(trained_run / "checkpoints" / "step_4", damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    overrides = tiny_overrides(small_corpus, tmp_path / "new", run__steps=6)
    code, err = run_cli(capsys, "train", *overrides, "--checkpoint.resume", str(damaged))
    assert_one_line_error(code, err, "is damaged", shard.name, "truncated")


def test_nan_loss_stops_without_losing_checkpoints(capsys, small_corpus, trained_run):
    before = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    overrides = tiny_overrides(small_corpus, trained_run, run__steps=12, train__lr=1e9,
                               train__min_lr=1e9, train__grad_clip=0, checkpoint__every=2)
    code, err = run_cli(capsys, "train", *overrides)
    assert_one_line_error(code, err, "loss is", "newest checkpoint", "step_4", "train.lr")
    after = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    assert after[: len(before)] == before  # what was saved is still there


def test_checkpoint_of_another_optimizer(capsys, small_corpus, trained_run, tmp_path):
    overrides = tiny_overrides(small_corpus, tmp_path / "new", train__optimizer="sgd")
    code, err = run_cli(capsys, "train", *overrides,
                        "--checkpoint.resume", str(trained_run / "checkpoints" / "step_4"))
    assert_one_line_error(code, err, "holds adamw state", "train.optimizer = sgd")


def test_checkpoint_of_another_model(capsys, small_corpus, trained_run, tmp_path):
    overrides = tiny_overrides(small_corpus, tmp_path / "new", model__dim=128)
    code, err = run_cli(capsys, "train", *overrides,
                        "--checkpoint.resume", str(trained_run / "checkpoints" / "step_4"))
    assert_one_line_error(code, err, "another model", "model.dim 64 in the checkpoint vs 128 now")


def test_generate_from_the_trained_run(trained_run):
    from polytrain.inference.load import generate_text, load_run

    run = load_run(trained_run)
    assert run.checkpoint.name == "step_4"
    text = generate_text(run, "def ", 8, temperature=0)
    assert text.startswith("def ") and len(text) > len("def ")
    assert generate_text(run, "def ", 8, temperature=0) == text  # greedy is deterministic


def test_console_script_reports_errors_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "train", "--model.size", "huge"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "model.size = 'huge'" in proc.stderr and "tiny" in proc.stderr
