"""Elastic jobs keep the global batch and the loss curve through hangs, lost workers and joining ones.

Local jobs (`--parallel.nproc MIN:MAX`, polytrain's launcher); torchrun's agents run the same
workers under --parallel.elastic. The reference is the single-process run of the same config (every data-parallel layout equals
it within 1e-5: tests/distributed/test_parity.py); the elastic runs change their world size
mid-run and must still match it at every step, the steps after each restart included.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from polytrain.cli import main
from polytrain.train.elastic_launch import read_events
from polytrain.train.faults import HANG_ENV, KILL_ENV, WAIT_ENV
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import train, train_rows

pytestmark = pytest.mark.slow
STEPS = 30
BATCH = {"train__global_batch_size": 12, "train__micro_batch_size": 3}  # kept at 4, 3 and 2 ranks


def assert_same_curve(reference: list[dict], got: list[dict], what: str) -> None:
    """Every step once, the loss within 1e-5 of the reference's; the gradient norm, a sum of
    squares the ranks add in another order, within 1e-4."""
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), what
    for a, b in zip(reference, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"{what}: loss at step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), f"{what}: grad norm at step {a['step']}"


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    train(tiny_overrides(small_corpus, run, run__steps=STEPS, **BATCH))
    return train_rows(run)


def test_hang_then_a_killed_worker_restart_and_finish_on_three(small_corpus, tmp_path, reference, monkeypatch):
    """4 workers; rank 1 hangs at step 5 (the watchdog ends the attempt, which restarts at 4);
    in that attempt rank 3 is SIGKILLed at step 12: the job finishes on 3 workers."""
    run = tmp_path / "run"
    monkeypatch.setenv(HANG_ENV, "1:5:0")
    monkeypatch.setenv(KILL_ENV, "3:12:1")
    args = tiny_overrides(small_corpus, run, run__steps=STEPS, checkpoint__snapshot_every=1,
                          run__hang_timeout_s=5, **BATCH)
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 0
    starts = [(e["attempt"], e["world"]) for e in read_events(run) if e["event"] == "start"]
    assert starts == [(0, 4), (1, 4), (2, 3)]
    report = (run / "hang" / "attempt_0" / "report.txt").read_text()
    assert report.startswith("hang: rank(s) [1] did not enter collective #")
    assert_same_curve(reference, train_rows(run), "elastic 4 -> (hang) 4 -> (kill) 3")
    events = read_events(run)
    death = next(e["time"] for e in events if e["event"] == "failure" and e["attempt"] == 1)
    again = next(e["time"] for e in events if e["event"] == "training" and e["time"] > death)
    print(f"death to training again: {again - death:.1f} s")


def test_lost_workers_coming_back_grow_the_job_from_two_to_four(small_corpus, tmp_path, reference, monkeypatch):
    """4 workers; ranks 2 and 3 are SIGKILLed at step 3, the job goes on with 2; once it runs at 2,
    SIGUSR1 to the launcher says the capacity is back: it waits at step 11 until the job restarts
    at 4 workers, and finishes there."""
    run = tmp_path / "run"
    monkeypatch.setenv(KILL_ENV, "2:3:0;3:3:0")
    monkeypatch.setenv(WAIT_ENV, "4:11")
    args = tiny_overrides(small_corpus, run, run__steps=STEPS, checkpoint__snapshot_every=1, **BATCH)

    def join_when_at_two() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if any(e["event"] == "training" and e["world"] == 2 for e in read_events(run)):
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=join_when_at_two, daemon=True)
    watcher.start()
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 0
    starts = [(e["attempt"], e["world"]) for e in read_events(run) if e["event"] == "start"]
    assert starts == [(0, 4), (1, 2), (2, 4)]
    assert_same_curve(reference, train_rows(run), "elastic 4 -> (2 killed) 2 -> (back) 4")


def test_a_global_batch_a_smaller_world_cannot_keep_is_refused(small_corpus, tmp_path, capsys):
    """One head and one block leave data parallelism as the only layout: 30 sequences do not split over 4."""
    args = tiny_overrides(small_corpus, tmp_path, train__global_batch_size=30, train__micro_batch_size=2,
                          model__n_heads=1, model__n_kv_heads=1, model__n_layers=1)
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 2
    assert ("error: train.global_batch_size = 30 cannot stay the same at 4 worker(s) of parallel.nproc = 2:4; "
            "world sizes that keep it: 1, 2, 3, 5, 6; global batches every size 2..4 keeps: 24 or 36") \
        in capsys.readouterr().err
