"""Elastic jobs keep the global batch and the loss curve through hangs, lost workers and joining ones.

Local jobs (`--parallel.nproc MIN:MAX`, polytrain's launcher); torchrun's agents run the same
workers under --parallel.elastic. The reference is the single-process run of the same config (every data-parallel layout equals
it within 1e-5: tests/distributed/test_parity.py); the elastic runs change their world size
mid-run and must still match it at every step, the steps after each restart included.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from polytrain.cli import main
from polytrain.train.elastic_launch import read_events
from polytrain.train.faults import HANG_ENV, KILL_ENV, RAISE_ENV, WAIT_ENV
from polytrain.train.snapshot import newest_resume_point
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


def devices_seen(events: list[dict], attempt: int) -> list[str]:
    """The device each worker of the attempt ran on, by rank: its local rank's entry in the visibility
    list it was given."""
    workers = sorted((e for e in events if e["event"] == "worker" and e["attempt"] == attempt),
                     key=lambda e: e["rank"])
    return [w["visible_devices"].split(",")[w["local_rank"]] for w in workers]


def test_hang_then_a_killed_worker_restart_and_finish_on_three(small_corpus, tmp_path, reference, monkeypatch):
    """4 workers; rank 1 hangs at step 5 (every rank's watchdog dumps, the report names rank 1 and the
    collective the others wait in, and the attempt restarts at 4 from the step-4 snapshot, on the same
    devices); in that attempt rank 1 is SIGKILLed at step 12: the job finishes on 3 workers from the
    step-8 snapshot, on the other three devices."""
    run = tmp_path / "run"
    monkeypatch.setenv(HANG_ENV, "1:5:0")
    monkeypatch.setenv(KILL_ENV, "1:12:1")
    args = tiny_overrides(small_corpus, run, run__steps=STEPS, checkpoint__snapshot_every=4,
                          run__hang_timeout_s=5, **BATCH)
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 0
    events = read_events(run)
    assert [(e["attempt"], e["world"]) for e in events if e["event"] == "start"] == [(0, 4), (1, 4), (2, 3)]
    assert [e["step"] for e in events if e["event"] == "training"] == [1, 5, 9]  # resumed at 4 and at 8
    assert [devices_seen(events, a) for a in range(3)] == [["0", "1", "2", "3"]] * 2 + [["0", "2", "3"]]
    hang = run / "hang" / "attempt_0"  # the watchdog's dumps of the attempt that hung
    report = (hang / "report.txt").read_text()
    assert report.startswith("hang: rank(s) [1] did not enter collective #"), report
    assert "of the group of ranks [0, 1, 2, 3] (all_reduce" in report and "which rank(s) [0, 2, 3] entered" in report
    dumps = {r: json.loads((hang / f"rank_{r}.json").read_text()) for r in range(4)}
    assert {d["step"] for d in dumps.values()} == {5}
    assert any("sleep(1)" in frame for frame in dumps[1]["stacks"]["MainThread"])
    assert [e for e in dumps[0]["entries"] if not e["done"]], "rank 0 waits in an unfinished collective"
    assert dumps[0]["errors"] == [] and {e["library"] for e in dumps[0]["entries"]} == {"gloo"}
    assert_same_curve(reference, train_rows(run), "elastic 4 -> (hang) 4 -> (kill) 3")
    death = next(e["time"] for e in events if e["event"] == "failure" and e["attempt"] == 1)
    again = next(e["time"] for e in events if e["event"] == "training" and e["time"] > death)
    print(f"death to training again: {again - death:.1f} s")


def test_an_exception_restarts_at_the_same_size_and_workers_joining_grow_the_job(small_corpus, tmp_path, reference,
                                                                                 monkeypatch):
    """The job starts with 2 of its 4 workers; rank 1 raises at step 7, which loses no device: the job
    restarts at 2 from its step-5 snapshot. Once it trains, SIGUSR1 to the launcher says the other two
    are free: the job (held at step 11 until then) restarts at 4 from its step-10 snapshot."""
    run = tmp_path / "run"
    monkeypatch.setenv(RAISE_ENV, "1:7:0")
    monkeypatch.setenv(WAIT_ENV, "4:11")
    args = tiny_overrides(small_corpus, run, run__steps=STEPS, checkpoint__snapshot_every=5,
                          parallel__nproc_start=2, **BATCH)

    def join_at_step_ten() -> None:
        # Once the step-10 snapshot is complete: step 10's metrics row is written before it.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                point = newest_resume_point(run)
            except (OSError, ValueError):  # read while it is being written: not complete yet
                point = None
            if point is not None and point.name == "step_10":
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.2)

    threading.Thread(target=join_at_step_ten, daemon=True).start()
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 0
    events = read_events(run)
    assert [(e["attempt"], e["world"]) for e in events if e["event"] == "start"] == [(0, 2), (1, 2), (2, 4)]
    assert [e["verdict"] for e in events if e["event"] == "failure"] == ["error"]
    assert [e["step"] for e in events if e["event"] == "training"] == [1, 6, 11]
    assert [devices_seen(events, a) for a in range(3)] == [["0", "1"], ["0", "1"], ["0", "1", "2", "3"]]
    assert_same_curve(reference, train_rows(run), "elastic 2 -> (exception) 2 -> (join) 4")


def test_a_global_batch_a_smaller_world_cannot_keep_is_refused(small_corpus, tmp_path, capsys):
    """One head and one block leave data parallelism as the only layout: 30 sequences do not split over 4."""
    args = tiny_overrides(small_corpus, tmp_path, train__global_batch_size=30, train__micro_batch_size=2,
                          model__n_heads=1, model__n_kv_heads=1, model__n_layers=1)
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 2
    assert ("error: train.global_batch_size = 30 cannot stay the same at 4 worker(s) of parallel.nproc = 2:4; "
            "world sizes that keep it: 1, 2, 3, 5, 6; global batches every size 2..4 keeps: 24 or 36") \
        in capsys.readouterr().err
