"""Hang detection: a watchdog thread per rank that notices a step which does not finish in time.

    watchdog = Watchdog(run_dir / "hang", timeout_s=0)      # 0 = derived from the step times seen
    with watchdog.watch("step", step):
        trainer.train_step()

When a watched section outlives its timeout, the watchdog of that rank

1. writes `hang/attempt_<n>/rank_<r>.json` (n counts the elastic agent's restarts): the
   Python stack of every thread, the rank's last collectives from torch's Flight Recorders
   (collective_log.py: the generic one and the collective library's own, NCCL's on GPUs;
   kind, process group and its ranks, sizes, dtypes, sequence number, whether it finished)
   and each group's last sequence numbers;
2. writes the marker `FIRED` there, which every other rank's watchdog notices within
   0.2 s and dumps too (so all dumps are of the same moment, a shared run directory
   across nodes included), waits a little for their dumps, and the first rank to see them
   all writes `report.txt`, naming the first rank and collective that disagree
   (hang_report.py), and prints it;
3. ends the process with EXIT_HANG, so the elastic agent (torchrun --max-restarts, or
   `polytrain train --parallel.nproc MIN:MAX`) restarts the attempt.

A thread whose interpreter is stuck in C while holding the GIL cannot run Python, so
faulthandler is armed for each watched section too: it writes every thread's stack
from C (`hang/rank_<r>.stacks.txt`) shortly after the timeout, whatever Python is doing.

The timeout (run.hang_timeout_s): > 0 seconds as given; 0 = derived: FACTOR x the slowest
completed section of that name, at least MIN_S; < 0 = no watchdog. The first section of
each name gets at least FIRST_S either way: it also builds, shards and warms up, which
can take minutes. Files left in the directory by an earlier round of the same attempt
number (torchrun's membership restarts keep the count) are older than this process and
ignored.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from polytrain.distributed.collective_log import BackendRecorder, collective_log
from polytrain.distributed.hang_report import analyse, format_report

EXIT_HANG = 3
FACTOR = 10.0
MIN_S = 60.0
FIRST_S = 900.0
GRACE_S = 10.0
"""How long a firing watchdog waits for the other ranks' dumps before reporting without them."""
FIRED = "FIRED"
"""Marker the first rank to fire writes; the others' watchdogs see it and dump at once."""


def python_stacks() -> dict[str, list[str]]:
    """Every thread's stack, innermost frame last, as 'file:line in function: source'."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        out[names.get(ident, str(ident))] = [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
                                             for f in traceback.extract_stack(frame)]
    return out


def hang_directory(run_dir: Path) -> Path:
    """<run dir>/hang/attempt_<n>: one directory per attempt of an elastic job, so restarts keep
    the dumps of the attempt that hung."""
    return Path(run_dir) / "hang" / f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class Watchdog:
    """One rank's watchdog (see the module docstring)."""

    def __init__(self, directory: Path, timeout_s: float = 0.0, grace_s: float = GRACE_S,
                 backend_recorder: BackendRecorder | None = None):
        """`backend_recorder`: the accelerator's `dump_flight_recorder`, read with torch's generic recorder."""
        self.directory = Path(directory)
        self.backend_recorder = backend_recorder
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.slowest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._watching: tuple[str, int, float, float] | None = None  # (section, step, started, timeout)
        self._stop = threading.Event()
        self.started = time.time()  # files in the directory older than this are a previous round's
        self._stacks_file = None
        self._thread = threading.Thread(target=self._run, name="polytrain-watchdog", daemon=True)
        if self.enabled:
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.timeout_s >= 0

    def timeout_for(self, section: str) -> float:
        """Seconds `section` may take now (see the module docstring)."""
        seen = self.slowest.get(section)
        if seen is None:  # the first of its kind also builds and warms up: FIRST_S, or more if asked
            return max(FIRST_S, self.timeout_s)
        return self.timeout_s if self.timeout_s > 0 else max(MIN_S, FACTOR * seen)

    @contextlib.contextmanager
    def watch(self, section: str, step: int, scale: float = 1.0) -> Iterator[None]:
        """Watch the block: it must finish within the section's timeout (times `scale`)."""
        if not self.enabled:
            yield
            return
        timeout = self.timeout_for(section) * scale
        started = time.monotonic()
        with self._lock:
            self._watching = (section, step, started, timeout)
        self._arm_faulthandler(timeout)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            took = time.monotonic() - started
            with self._lock:
                self._watching = None
            self.slowest[section] = max(self.slowest.get(section, 0.0), took)

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._stacks_file is not None:
            self._stacks_file.close()

    def _arm_faulthandler(self, timeout: float) -> None:
        # The C-level fallback fires after the Python watchdog had its chance to dump and report.
        if self._stacks_file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._stacks_file = open(self.directory / f"rank_{self.rank}.stacks.txt", "w")  # noqa: SIM115
        faulthandler.dump_traceback_later(timeout + 2 * self.grace_s + 5, repeat=False, file=self._stacks_file,
                                          exit=True)

    def _run(self) -> None:
        marker = self.directory / FIRED
        while not self._stop.wait(0.2):
            with self._lock:
                watching = self._watching
            # Another rank fired (in this round: older markers are a previous round's): dump now too,
            # so every rank's dump is of the same moment.
            fired = _mtime(marker) >= self.started
            if watching is None and not fired:
                continue
            section, step, started, timeout = watching or ("between sections", -1, time.monotonic(), 0.0)
            waited = time.monotonic() - started
            if waited > timeout or fired:
                self._fire(section, step, waited, timeout)

    def _fire(self, section: str, step: int, waited: float, timeout: float) -> None:
        """Mark the round as hung, dump, report (the first rank to see every dump), end the attempt."""
        self.directory.mkdir(parents=True, exist_ok=True)
        marker = self.directory / FIRED
        if _mtime(marker) < self.started:
            marker.write_text(f"rank {self.rank}: {section} {step} after {waited:.0f} s\n")
        since = _mtime(marker) - self.grace_s  # dumps of this round, not a previous one's
        dump = {"rank": self.rank, "world_size": self.world, "host": socket.gethostname(), "pid": os.getpid(),
                "section": section, "step": step, "waited_s": round(waited, 3), "timeout_s": timeout,
                "stacks": python_stacks(), **collective_log(self.backend_recorder)}
        path = self.directory / f"rank_{self.rank}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dump, indent=1))
        os.replace(tmp, path)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and len(self._dumps(since)) < self.world:
            time.sleep(0.2)
        self._report(since)
        print(f"error: rank {self.rank}: {section} {step} has not finished after {waited:.0f} s (timeout "
              f"{timeout:.0f} s); stacks and collectives in {self.directory}", file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)

    def _dumps(self, since: float) -> list[Path]:
        return [p for p in sorted(self.directory.glob("rank_*.json")) if _mtime(p) >= since]

    def _report(self, since: float) -> None:
        """Write report.txt once per round (whichever rank gets there first) and print it."""
        dumps = [json.loads(p.read_text()) for p in self._dumps(since)]
        text = format_report(analyse(dumps, self.world), dumps)
        path = self.directory / "report.txt"
        if _mtime(path) >= since:
            return  # another rank wrote this round's
        tmp = path.with_name(f"report.{self.rank}.tmp")
        tmp.write_text(text + "\n")
        try:
            os.link(tmp, path)  # atomic, and fails if another rank's is already there
        except FileExistsError:
            if _mtime(path) >= since:
                tmp.unlink()
                return
            os.replace(tmp, path)  # a previous round's report: this round's replaces it
        else:
            tmp.unlink()
        print(text, file=sys.stderr, flush=True)


def _mtime(path: Path) -> float:
    """Modification time (wall clock), or -inf for a missing file."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("-inf")
