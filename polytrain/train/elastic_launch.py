"""An elastic job on this machine: `polytrain train --parallel.nproc MIN:MAX`.

The launcher starts MAX workers (or parallel.nproc_start: those free now), each
`python -m polytrain.train` with torchrun's environment (
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT) and the
accelerator's visibility variable (CUDA_VISIBLE_DEVICES, ...) listing the attempt's devices,
which each worker's local rank indexes (elastic_devices.py), and watches them:

- all exit 0: the job is done;
- one exits 2 (a config error it already printed): the job stops with 2;
- one is killed by a signal (SIGKILL, the OOM killer's, a crash in C): its device is lost, the
  others are stopped, and the job restarts with one worker fewer for each lost device, on the
  devices left (the lost ones are no longer listed), as long as at least MIN remain;
- one hangs (exit 3, the watchdog's: polytrain/distributed/watchdog.py) or fails otherwise (a
  Python exception): the others are stopped and the attempt restarts at the same size, on the
  same devices;
- SIGUSR1 to the launcher says every device of the job is usable (those it was not given yet,
  or a lost one back): the job restarts at MAX workers.

Each restart counts against `parallel.max_restarts`. A restarted job resumes from the
newest checkpoint or host-memory snapshot (`checkpoint.snapshot_every`) at its new size,
with the layout planned for that size before the job started (elastic.py). Across
nodes, torchrun's own agent does the same (`torchrun --nnodes MIN:MAX --max-restarts R ...
-m polytrain.train --parallel.elastic true`), without leaving out lost devices.

Every membership event goes to <run dir>/elastic.jsonl with a wall-clock time (the trainer
adds when training runs again, and each worker the devices it was given), so the time from a
death to training again can be read off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from polytrain.train.elastic_devices import EXIT_USER_ERROR, device_pool, judge_failure

SETTLE_S = 1.0
"""After the first failure, how long to let other deaths of the same event (an OOM kill of several) arrive."""
EVENTS_FILE = "elastic.jsonl"
ELASTIC_ENV = "POLYTRAIN_ELASTIC"  # set for the workers of an elastic job (this launcher's, or by hand under torchrun)
STOP_GRACE_S = 5.0


def record_event(run_dir: Path, event: str, **fields) -> None:
    """Append one membership event to <run dir>/elastic.jsonl (one line, flushed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / EVENTS_FILE, "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Attempt:
    """One start of the workers at one world size."""

    number: int
    devices: list[str]
    """Device ids, one a worker: local rank i runs on devices[i]."""
    procs: list[subprocess.Popen]

    @property
    def world(self) -> int:
        return len(self.devices)


class ElasticLauncher:
    """Starts, watches and restarts the local workers (see the module docstring)."""

    def __init__(self, min_workers: int, max_workers: int, argv: list[str], run_dir: Path, max_restarts: int,
                 visible_devices_env: str, start_workers: int = 0, module: str = "polytrain.train"):
        """`visible_devices_env`: the accelerator's visibility variable (Accelerator.visible_devices_env)."""
        self.min, self.max, self.argv, self.run_dir = min_workers, max_workers, argv, Path(run_dir)
        self.start_workers = start_workers or max_workers
        self.max_restarts, self.module = max_restarts, module
        self.visible_devices_env = visible_devices_env
        self.pool = device_pool(visible_devices_env, max_workers, os.environ)
        self.lost: set[str] = set()
        self.run_id = f"polytrain-{uuid.uuid4().hex[:8]}"
        self._joins = 0

    def _on_join(self, signum, frame) -> None:
        self._joins += 1

    def _devices(self, world: int) -> list[str]:
        """The first `world` devices of the pool that are not lost."""
        return [d for d in self.pool if d not in self.lost][:world]

    def _start(self, number: int, world: int) -> Attempt:
        port = _free_port()
        threads = str(max(1, (os.cpu_count() or 1) // world))
        devices = self._devices(world)
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(number),
                   "TORCHELASTIC_RUN_ID": self.run_id, "POLYTRAIN_LAUNCHED": "1", ELASTIC_ENV: "1",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
                   self.visible_devices_env: ",".join(devices)}
            procs.append(subprocess.Popen([sys.executable, "-u", "-m", self.module, *self.argv], env=env))
        record_event(self.run_dir, "start", attempt=number, world=world, devices=devices)
        return Attempt(number, devices, procs)

    def _stop(self, attempt: Attempt) -> None:
        """SIGTERM the workers still running, SIGKILL those that outlive the grace."""
        for p in attempt.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in attempt.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _watch(self, attempt: Attempt) -> str:
        """Wait for the attempt's outcome: done, join, or a failure's verdict (elastic_devices.py: user_error,
        lost, whose devices go into self.lost, hang or error)."""
        while True:
            codes = [p.poll() for p in attempt.procs]
            if any(c not in (None, 0) for c in codes):
                time.sleep(SETTLE_S)
                failed = [(rank, c) for rank, p in enumerate(attempt.procs) if (c := p.poll()) not in (None, 0)]
                verdict = judge_failure(failed)
                lost = [attempt.devices[rank] for rank in verdict.lost_ranks]
                self.lost.update(lost)
                record_event(self.run_dir, "failure", attempt=attempt.number, ranks=[r for r, _ in failed],
                             codes=[c for _, c in failed], verdict=verdict.kind, lost_devices=lost)
                return verdict.kind
            if all(c == 0 for c in codes):
                return "done"
            if self._joins and attempt.world < self.max:
                return "join"
            time.sleep(0.1)

    def run(self) -> int:
        """Run the job to the end; returns its exit code."""
        previous = signal.signal(signal.SIGUSR1, self._on_join)
        world, number = self.start_workers, 0
        try:
            while True:
                attempt = self._start(number, world)
                outcome = self._watch(attempt)
                self._stop(attempt)
                if outcome == "done":
                    record_event(self.run_dir, "done", attempt=number, world=world)
                    return 0
                if outcome == "user_error":
                    return EXIT_USER_ERROR
                if outcome == "lost":
                    world = len([d for d in attempt.devices if d not in self.lost])  # one fewer a lost device
                elif outcome == "join":  # every device is usable: the lost ones are back too
                    world, self._joins, self.lost = self.max, 0, set()
                if number >= self.max_restarts:
                    print(f"error: the job {self._said(outcome)} and has used its {self.max_restarts} restarts "
                          f"(parallel.max_restarts)", file=sys.stderr)
                    return 1
                if world < self.min:
                    print(f"error: {world} worker(s) left, fewer than the {self.min} of parallel.nproc = "
                          f"{self.min}:{self.max}; the newest checkpoint resumes the run", file=sys.stderr)
                    return 1
                number += 1
                print(f"polytrain: the job {self._said(outcome)}; restarting with {world} worker(s) "
                      f"(restart {number} of at most {self.max_restarts})", file=sys.stderr, flush=True)
        finally:
            signal.signal(signal.SIGUSR1, previous)

    @staticmethod
    def _said(outcome: str) -> str:
        return {"hang": "hung (see hang/ in the run directory)", "lost": "lost device(s)",
                "error": "failed (its traceback is above)", "join": "has its workers back"}[outcome]
