"""Elastic jobs keep the global batch and the loss curve through hangs, lost workers and joining ones.

The reference is the single-process run of the same config (every data-parallel layout equals
it within 1e-5: tests/distributed/test_parity.py); the elastic runs change their world size
mid-run and must still match it at every step, the steps after each restart included.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from polytrain.cli import main
from polytrain.train.elastic_launch import read_events
from polytrain.train.faults import HANG_ENV, KILL_ENV
from tests.conftest import tiny_overrides
from tests.distributed.test_parity import assert_same_trajectory, train, train_rows

pytestmark = pytest.mark.slow
STEPS = 30
BATCH = {"train__global_batch_size": 12, "train__micro_batch_size": 3}  # kept at 4, 3 and 2 ranks


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
                          run__hang_timeout_s=3, **BATCH)
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 0
    starts = [(e["attempt"], e["world"]) for e in read_events(run) if e["event"] == "start"]
    assert starts == [(0, 4), (1, 4), (2, 3)]
    report = (run / "hang" / "attempt_0" / "report.txt").read_text()
    assert report.startswith("hang: rank(s) [1] did not enter collective #")
    assert_same_trajectory(reference, train_rows(run), 1e-5, "elastic 4 -> (hang) 4 -> (kill) 3")
    events = read_events(run)
    death = next(e["time"] for e in events if e["event"] == "failure" and e["attempt"] == 1)
    again = next(e["time"] for e in events if e["event"] == "training" and e["time"] > death)
    print(f"death to training again: {again - death:.1f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(port: int, args: list[str]) -> subprocess.Popen:
    """One torchrun agent (a 'node' of one worker) of the job at 127.0.0.1:port."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:4",
                             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             f"127.0.0.1:{port}", "--rdzv-id", f"join-{port}", "--max-restarts", "3",
                             "--monitor-interval", "0.5", "-m", "polytrain.train", *args,
                             "--parallel.elastic", "true"], env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_workers_joining_under_torchrun_grow_the_job_from_two_to_four(small_corpus, tmp_path, reference):
    run = tmp_path / "run"
    args = tiny_overrides(small_corpus, run, run__steps=STEPS, checkpoint__snapshot_every=1, **BATCH)
    port = _free_port()
    agents = [_agent(port, args) for _ in range(2)]
    deadline = time.monotonic() + 600
    while not any(r["step"] >= 10 for r in train_rows(run) if (run / "metrics.jsonl").exists()):
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the first two stalled"
        time.sleep(0.5)
    agents += [_agent(port, args) for _ in range(2)]
    for a in agents:
        assert a.wait(timeout=600) == 0
    worlds = [e["world"] for e in read_events(run) if e["event"] == "training"]
    assert worlds[0] == 2 and worlds[-1] == 4
    assert_same_trajectory(reference, train_rows(run), 1e-5, "torchrun 2 -> 4")


def test_a_global_batch_a_smaller_world_cannot_keep_is_refused(small_corpus, tmp_path, capsys):
    args = tiny_overrides(small_corpus, tmp_path, train__global_batch_size=30, train__micro_batch_size=2)
    assert main(["train", *args, "--parallel.nproc", "2:4"]) == 2
    assert ("error: train.global_batch_size = 30 cannot stay the same at 4 worker(s) of parallel.nproc = 2:4; "
            "world sizes that keep it: 1, 2, 3, 5, 6; global batches every size 2..4 keeps: 24 or 36") \
        in capsys.readouterr().err
