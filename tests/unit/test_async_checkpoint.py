"""Asynchronous checkpoint saves: training goes on while the writer runs, one write in flight,
errors surface at the next save or wait, and a kill mid-write leaves the previous checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from polytrain.checkpoint import Checkpointer, TrainerState, latest_checkpoint, load_in_place, verify_checkpoint
from polytrain.checkpoint import directory
from polytrain.checkpoint.async_save import stage_to_host
from polytrain.errors import CheckpointError


class Weights:
    """What the trainer hands Checkpointer.save: a Stateful with model and optimizer tensors."""

    def __init__(self):
        self.w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        self.m = torch.ones(4)

    def state_dict(self):
        # The tied weight appears twice, as in model.state_dict(); "step" is a non-tensor value.
        return {"model": {"w": self.w, "tied": self.w}, "optim": {"m": self.m, "step": 3}}


def state(step: int) -> TrainerState:
    return TrainerState(step=step, sampler={"consumed": step * 8}, optimizer="adamw",
                        model_config={"dim": 4}, world_size=1)


def checkpointer(run_dir: Path) -> Checkpointer:
    return Checkpointer(run_dir, 0, lambda: {"seed": 1}, lambda rng: None, async_save=True)


def saved_w(path: Path) -> torch.Tensor:
    out = {"model": {"w": torch.zeros(3, 4)}}
    load_in_place(out, path)
    return out["model"]["w"]


@pytest.fixture
def blocked_writer(monkeypatch):
    """The writer stops after its shards, until `release` is set: an artificially slow disk."""
    entered, release = threading.Event(), threading.Event()
    real = directory._write_rank_part

    def slow(*args):
        real(*args)
        entered.set()
        assert release.wait(30), "the test never released the writer"

    monkeypatch.setattr(directory, "_write_rank_part", slow)
    yield entered, release
    release.set()


def test_a_step_runs_while_the_writer_is_blocked(tmp_path, blocked_writer):
    entered, release = blocked_writer
    weights, ckpt = Weights(), checkpointer(tmp_path)
    before = weights.w.clone()
    final = ckpt.save(weights, state(1))  # returns with the write in flight
    assert entered.wait(10)
    weights.w.add_(100.0)  # a training step's in-place update, while the writer is still blocked
    assert ckpt._writer.busy and not final.exists()
    release.set()
    ckpt.wait()
    assert latest_checkpoint(tmp_path) == final
    verify_checkpoint(final)
    assert torch.equal(saved_w(final), before)  # the staged copy, not the updated weights


def test_one_save_in_flight(tmp_path, blocked_writer):
    entered, release = blocked_writer
    weights, ckpt = Weights(), checkpointer(tmp_path)
    ckpt.save(weights, state(1))
    assert entered.wait(10)
    entered.clear()
    second = threading.Thread(target=ckpt.save, args=(weights, state(2)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waits for the first write, still blocked
    assert not (tmp_path / "checkpoints" / ".tmp-step_2").exists()
    release.set()
    second.join(10)
    ckpt.wait()
    assert latest_checkpoint(tmp_path).name == "step_2"


def test_a_failed_background_write_surfaces_at_the_next_save(tmp_path, monkeypatch):
    weights, ckpt = Weights(), checkpointer(tmp_path)
    ckpt.save(weights, state(1))
    ckpt.wait()

    def full_disk(tmp, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "__0_0.distcp"))

    monkeypatch.setattr(directory, "_write_rank_part", full_disk)
    ckpt.save(weights, state(2))  # returns: the failure happens in the thread
    with pytest.raises(CheckpointError, match=r"step_2 failed on rank 0: cannot write .*__0_0\.distcp.*intact"):
        ckpt.save(weights, state(3))
    assert latest_checkpoint(tmp_path).name == "step_1"
    assert not (tmp_path / "checkpoints" / ".tmp-step_2").exists()
    ckpt.save(weights, state(4))  # the next save's own error
    with pytest.raises(CheckpointError, match="step_4 failed"):
        ckpt.wait()
    ckpt.wait()  # raised once, then cleared


def test_staging_copies_every_tensor_once():
    w = torch.ones(2, 2)
    sd = {"a": w, "b": w, "groups": [{"lr": 0.1, "params": ["a"]}], "n": torch.tensor(3)}
    staged = stage_to_host(sd)
    assert staged["a"] is staged["b"] and staged["a"].data_ptr() != w.data_ptr()
    assert staged["groups"] == sd["groups"] and staged["groups"] is not sd["groups"]
    w.add_(1)
    assert torch.equal(staged["a"], torch.ones(2, 2)) and staged["n"].item() == 3


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from polytrain.checkpoint import directory
    from tests.unit.test_async_checkpoint import Weights, checkpointer, state

    run_dir = Path(sys.argv[1])
    weights, ckpt = Weights(), checkpointer(run_dir)
    ckpt.save(weights, state(1))
    ckpt.wait()
    real = directory._write_rank_part

    def stuck(*args):
        real(*args)                                   # step 2's shards are on disk ...
        (run_dir / "writer-stuck").write_text("")     # ... and the writer hangs before the rest
        time.sleep(600)

    directory._write_rank_part = stuck
    weights.w.add_(1)
    ckpt.save(weights, state(2))
    while True:                                       # training goes on until the kill
        weights.w.add_(1)
        time.sleep(0.01)
""")


def test_kill_during_an_async_save_keeps_the_previous_checkpoint(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], env=env, cwd=root,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "writer-stuck").exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the writer never reached step 2's shards"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-save, as a power cut or the OOM killer would
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    checkpoints = tmp_path / "checkpoints"
    assert any((checkpoints / ".tmp-step_2").glob("*.distcp"))  # the partial save is there ...
    assert latest_checkpoint(tmp_path) == checkpoints / "step_1"  # ... and ignored
    verify_checkpoint(checkpoints / "step_1")
    assert torch.equal(saved_w(checkpoints / "step_1"), Weights().w)
    checkpointer(tmp_path).clear_partial()  # what the next run does first
    assert not (checkpoints / ".tmp-step_2").exists()
