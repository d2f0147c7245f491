"""Checkpoint faults end in one `error:` line that names the file and the fix, exit 2, and leave
the previous checkpoint loadable: a file damaged after saving (found by manifest.json's digests),
a garbled .metadata or RNG-state file, a full disk while saving, one rank failing its save while
the other waits. The only multi-rank launch is `two_rank_run`, shared by every test here.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.cli import main
from tests.conftest import tiny_overrides
from tests.e2e.test_bad_input import documented, matches


def polytrain(*args: str, env: dict | None = None, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polytrain.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          preexec_fn=preexec_fn)


def one_error_line(stderr: str) -> str:
    """The one `error:` line, last and without a traceback (rank 0's progress log may precede it)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def two_rank_run(small_corpus, tmp_path_factory):
    """2 ranks, ZeRO-3, a checkpoint each step; at step 2 rank 1 cannot write its RNG file."""
    run = tmp_path_factory.mktemp("two-ranks") / "run"
    args = tiny_overrides(small_corpus, run, run__steps=2, checkpoint__every=1)
    done = polytrain("train", *args, "--parallel.nproc", "2", "--parallel.zero", "3",
                     env={"POLYTRAIN_TEST_FAIL_RNG_SAVE": "2:1"})
    return run, done


def _copy(run: Path, tmp: Path) -> Path:
    shutil.copytree(run, tmp / "run")
    return tmp / "run"


def _flip(file: Path, at: int, n: int) -> None:
    data = bytearray(file.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    file.write_bytes(bytes(data))


def test_rank_failing_its_save_stops_every_rank(two_rank_run):
    run, done = two_rank_run
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert matches(documented()["checkpoint-rank-save-fails"], line), line
    checkpoints = run / "checkpoints"
    assert (checkpoints / "step_1" / "trainer.json").is_file()
    assert not (checkpoints / "step_2").exists() and not (checkpoints / ".tmp-step_2").exists()


def test_full_disk_while_saving_then_resume(two_rank_run, small_corpus, tmp_path):
    run = _copy(two_rank_run[0], tmp_path)
    args = ["train", *tiny_overrides(small_corpus, run, run__steps=2, checkpoint__every=1)]

    def small_files():  # every file past 1 MiB fails with EFBIG, as on a full disk (not killed by SIGXFSZ)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    full = polytrain(*args, preexec_fn=small_files)  # resumes step_1 (2 ranks wrote it), fails at step 2
    assert full.returncode == 2
    line = one_error_line(full.stderr)
    assert matches(documented()["checkpoint-disk-full"], line), line
    assert not (run / "checkpoints" / "step_2").exists()

    resumed = polytrain(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in resumed.stdout
    assert (run / "checkpoints" / "step_2" / "manifest.json").is_file()


def test_flipped_bytes_are_found(two_rank_run, small_corpus, tmp_path, capsys):
    run = _copy(two_rank_run[0], tmp_path)
    shard = run / "checkpoints" / "step_1" / "__1_0.distcp"  # rank 1 wrote it; the digests were shared out
    _flip(shard, shard.stat().st_size // 2, 4096)
    for argv in (["generate", str(run), "--prompt", "x", "--max-new-tokens", "2"],
                 ["train", *tiny_overrides(small_corpus, run, run__steps=2)]):
        assert main(argv) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "step_1 is damaged: __1_0.distcp does not match its checksum" in line, line


def test_checkpoint_without_manifest_loads_unchecked(two_rank_run, tmp_path, capsys):
    run = _copy(two_rank_run[0], tmp_path)  # as written before manifests existed
    (run / "checkpoints" / "step_1" / "manifest.json").unlink()
    assert main(["generate", str(run), "--prompt", "x", "--max-new-tokens", "2"]) == 0, capsys.readouterr().err


def test_garbled_rng_file_of_an_older_checkpoint(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", *tiny_overrides(small_corpus, run, run__steps=1)]
    assert main(args) == 0
    step = run / "checkpoints" / "step_1"
    (step / "manifest.json").unlink()  # no digests: the file's own header is all there is to check
    _flip(step / "rng" / "rank_0.pt", 0, 64)
    capsys.readouterr()
    assert main(["train", *tiny_overrides(small_corpus, run, run__steps=2)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "step_1 is damaged: rng/rank_0.pt cannot be read" in line and "earlier one" in line, line
