"""Every row of docs/ERRORS.md: the input it names gives the message it shows (or runs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from polytrain.cli import main
from tests.conftest import tiny_overrides

TABLE = Path(__file__).resolve().parents[2] / "docs" / "ERRORS.md"


def documented() -> dict[str, str]:
    """id -> message, from the table's rows."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("id", "---"):
            rows[cells[0]] = cells[2]
    return rows


def matches(message: str, line: str) -> bool:
    """Whether `line` is `message` with each `…` standing for any text."""
    return re.fullmatch(".*?".join(re.escape(piece) for piece in message.split("…")), line) is not None


@pytest.fixture(scope="module")
def prepared(small_corpus, tmp_path_factory) -> Path:
    """A directory holding d.bin and its siblings (512-token BPE)."""
    from polytrain.data import prepare_to

    out = tmp_path_factory.mktemp("prepared") / "d.bin"
    prepare_to(str(small_corpus), out, vocab_size=512, val_fraction=0.1)
    return out.parent


@pytest.fixture(scope="module")
def run_dir(prepared, tmp_path_factory) -> Path:
    """A tiny run trained for one step on the prepared data."""
    from tests.distributed.test_parity import train

    run = tmp_path_factory.mktemp("run")
    train(tiny_overrides(prepared / "d.bin", run, run__steps=1, run__eval_batches=1))
    return run


def _data(prepared: Path, tmp: Path, edit: Callable[[Path], None]) -> Path:
    """A copy of the prepared files with `edit` applied to the copy's directory; returns its d.bin."""
    shutil.copytree(prepared, tmp / "data")
    edit(tmp / "data")
    return tmp / "data" / "d.bin"


def _sidecar(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        meta = json.loads((directory / "d.json").read_text())
        (directory / "d.json").write_text(json.dumps(change(meta)))
    return edit


def _id_600_at_100(directory: Path) -> None:
    tokens = np.fromfile(directory / "d.bin", dtype="<u2")
    tokens[100] = 600
    tokens.tofile(directory / "d.bin")


def _train(prepared: Path, tmp: Path, edit: Callable[[Path], None]) -> list[str]:
    return ["train", *tiny_overrides(_data(prepared, tmp, edit), tmp / "run")]


def _tiny(prepared: Path, tmp: Path, *extra: str) -> list[str]:
    """A seconds-long run on good data with `extra` overrides (a run that should not start)."""
    return ["train", *tiny_overrides(prepared / "d.bin", tmp / "run", run__steps=1), *extra]


def _remove(key: str) -> Callable[[dict], dict]:
    return lambda meta: {k: v for k, v in meta.items() if k != key}


def _outside(meta: dict) -> dict:
    return {**meta, "train": {**meta["train"], "file": "../d.bin"}}


def _file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("x")
    return tmp / "a_file"


def _hf_dir(run: Path, tmp: Path) -> Path:
    from polytrain.convert import export_hf

    return export_hf(run, tmp / "hf")


def _damaged_run(run: Path, tmp: Path, name: str, at: Callable[[int], int], n: int) -> list[str]:
    """`polytrain generate` on a copy of `run` whose step_1/`name` has n bytes flipped at at(size)."""
    shutil.copytree(run, tmp / "run")
    file = tmp / "run" / "checkpoints" / "step_1" / name
    data = bytearray(file.read_bytes())
    start = at(len(data))
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    file.write_bytes(bytes(data))
    return ["generate", str(tmp / "run"), "--prompt", "x", "--max-new-tokens", "2"]


def _out_bin_dir(tmp: Path) -> Path:
    (tmp / "out.bin").mkdir()
    return tmp / "out.bin"


# id -> (prepared data dir, trained run dir, this case's tmp dir) -> argv of `polytrain`
CASES: dict[str, Callable[[Path, Path, Path], list[str]]] = {
    "sidecar-not-json": lambda d, r, t: _train(d, t, lambda p: (p / "d.json").write_text('{"format": "poly')),
    "sidecar-field": lambda d, r, t: _train(d, t, _sidecar(_remove("dtype"))),
    "sidecar-path": lambda d, r, t: _train(d, t, _sidecar(_outside)),
    "token-id-range": lambda d, r, t: _train(d, t, _id_600_at_100),
    "run-dir-not-writable": lambda d, r, t: ["train", *tiny_overrides(d / "d.bin", _file(t))],
    "negative-setting": lambda d, r, t: _tiny(d, t, "--train.warmup_steps", "-1"),
    "eval-batches-zero": lambda d, r, t: _tiny(d, t, "--run.eval_batches", "0"),
    "generate-empty-prompt": lambda d, r, t: ["generate", str(r), "--prompt", "", "--max-new-tokens", "4"],
    "sampling-top-k": lambda d, r, t: ["generate", str(r), "--prompt", "x", "--top-k", "0"],
    "sampling-top-p": lambda d, r, t: ["generate", str(r), "--prompt", "x", "--top-p", "0"],
    "sampling-temperature": lambda d, r, t: ["generate", str(r), "--prompt", "x", "--temperature", "-1"],
    "sampling-max-new-tokens": lambda d, r, t: ["generate", str(r), "--prompt", "x", "--max-new-tokens", "-3"],
    "missing-argument": lambda d, r, t: ["generate", str(r)],
    "prepare-val-fraction": lambda d, r, t: ["prepare", "stdlib", str(t / "o.bin"), "--val-fraction", "1.5"],
    "prepare-vocab-size": lambda d, r, t: ["prepare", "stdlib", str(t / "o.bin"), "--vocab-size", "10"],
    "prepare-out-is-dir": lambda d, r, t: ["prepare", str(d / "d.bin"), str(_out_bin_dir(t))],
    "checkpoint-damaged": lambda d, r, t: _damaged_run(r, t, "__0_0.distcp", lambda size: size // 2, 4096),
    "checkpoint-metadata-garbled": lambda d, r, t: _damaged_run(r, t, ".metadata", lambda size: 0, 64),
    "consolidate-run-dir": lambda d, r, t: ["consolidate", str(r), str(t / "model.safetensors")],
    "export-out-is-file": lambda d, r, t: ["convert", "--to", "hf", str(r), str(_file(t))],
    "import-out-is-file": lambda d, r, t: ["convert", str(_hf_dir(r, t)), str(_file(t))],
}
# through `polytrain train`, in a subprocess: here, and in tests/e2e/test_checkpoint_faults.py
LAUNCHED = {"token-id-range-2-ranks", "checkpoint-disk-full", "checkpoint-rank-save-fails"}


def test_every_row_has_a_case():
    assert sorted(documented()) == sorted([*CASES, *LAUNCHED])


@pytest.mark.parametrize("row", sorted(CASES))
def test_row(row, prepared, run_dir, tmp_path, capsys):
    message = documented()[row]
    code = main(CASES[row](prepared, run_dir, tmp_path))
    err = capsys.readouterr().err
    if message.startswith("runs:"):
        assert code == 0, err
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert matches(message, lines[0]), f"\n{lines[0]}\n{message}"


def test_row_token_id_range_on_two_ranks(prepared, tmp_path):
    """Rank 0 finds the bad id while rank 1 waits: one line, once, exit 2, no traceback."""
    argv = _train(prepared, tmp_path, _id_600_at_100)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "polytrain.cli", *argv, "--parallel.nproc", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert matches(documented()["token-id-range-2-ranks"], lines[0]), lines[0]
