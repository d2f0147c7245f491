"""Which devices each attempt of a local elastic job runs on, and which failures lose one.

    pool = device_pool("CUDA_VISIBLE_DEVICES", max_workers=4, environ=os.environ)   # ['0', '1', '2', '3']
    verdict = judge_failure([(1, -9), (0, 1), (2, 1), (3, 1)])   # Verdict('lost', lost_ranks=(1,))

A worker's device is the one its local rank indexes in the visibility variable the launcher
gives it (the accelerator's: CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES, ...; on the CPU
polytrain's own POLYTRAIN_VISIBLE_DEVICES, which only the launcher and its workers read). When a
device is lost, the next attempt's list leaves it out, so the survivors' ranks index healthy
devices only, whichever local rank died.

How a failure is judged, from the exit codes of the workers that ended (the first of them, and
any others within the launcher's settle time):

- exit 2 (EXIT_USER_ERROR, a config error the worker printed): the job stops;
- killed by a signal (SIGKILL, the OOM killer's; a crash in C, SIGSEGV or SIGBUS, which a failing
  device can cause): the worker's device is lost and the job goes on without it; its peers' own
  failures (their collectives broke) are consequences;
- exit 3 (EXIT_HANG, the watchdog's): the attempt restarts on the same devices;
- any other exit (a Python exception): the same; the program failed, not the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polytrain.errors import ConfigError

EXIT_USER_ERROR = 2
EXIT_HANG = 3


@dataclass(frozen=True)
class Verdict:
    """What a failure means for the job: `kind` is user_error, lost, hang or error."""

    kind: str
    lost_ranks: tuple[int, ...] = ()
    """Local ranks whose devices are lost (kind 'lost')."""


def judge_failure(failed: list[tuple[int, int]]) -> Verdict:
    """The verdict on the (local rank, exit code) of the workers that failed (see the module docstring);
    a negative code is a signal's number, as subprocess reports it."""
    codes = [code for _, code in failed]
    if EXIT_USER_ERROR in codes:
        return Verdict("user_error")
    killed = tuple(sorted(rank for rank, code in failed if code < 0))
    if killed:
        return Verdict("lost", killed)
    return Verdict("hang" if EXIT_HANG in codes else "error")


def device_pool(env_name: str, max_workers: int, environ: Mapping[str, str]) -> list[str]:
    """The device ids a job of up to `max_workers` local workers may use: the first `max_workers` that
    `env_name` lists where it is set (the user chose them, e.g. CUDA_VISIBLE_DEVICES=4,5,6,7), else
    0 .. max_workers - 1."""
    listed = environ.get(env_name)
    if listed is None:
        return [str(i) for i in range(max_workers)]
    pool = [d.strip() for d in listed.split(",") if d.strip()]
    if len(pool) < max_workers:
        raise ConfigError(f"parallel.nproc asks for up to {max_workers} local workers, one a device, but "
                          f"{env_name}={listed!r} lists {len(pool)}; list {max_workers} or more devices there, "
                          f"or lower the MAX of parallel.nproc")
    return pool[:max_workers]
