"""Test hooks that make one rank fail at a chosen step, as real faults would (off unless set).

    POLYTRAIN_TEST_HANG="RANK:STEP[:ATTEMPT]"   that rank stops before the step's collectives
    POLYTRAIN_TEST_KILL="RANK:STEP[:ATTEMPT]"   that rank SIGKILLs itself at the start of the step
    POLYTRAIN_TEST_RAISE="RANK:STEP[:ATTEMPT]"  that rank raises a RuntimeError there (a bug, not a
                                                lost device)
                                                (';' separates several points)
    POLYTRAIN_TEST_WAIT_FOR_WORLD="WORLD:STEP"  every rank waits at that step until the job has WORLD
                                                ranks (an elastic agent restarts it when workers join)

ATTEMPT (default 0) is the elastic restart count (TORCHELASTIC_RESTART_COUNT) the fault
fires in, so a restarted job runs on.
"""

from __future__ import annotations

import os
import signal
import time

HANG_ENV = "POLYTRAIN_TEST_HANG"
KILL_ENV = "POLYTRAIN_TEST_KILL"
RAISE_ENV = "POLYTRAIN_TEST_RAISE"
WAIT_ENV = "POLYTRAIN_TEST_WAIT_FOR_WORLD"


def _fires(env: str, rank: int, step: int) -> bool:
    """Whether one of the env's ';'-separated RANK:STEP[:ATTEMPT] points is this rank, step and attempt."""
    attempt_now = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for point in filter(None, os.environ.get(env, "").split(";")):
        parts = [int(x) for x in point.split(":")]
        if (parts[0], parts[1]) == (rank, step) and (parts[2] if len(parts) > 2 else 0) == attempt_now:
            return True
    return False


def inject_faults(rank: int, step: int) -> None:
    """Hang, die or raise here if a test asked this rank to at this step (see the module docstring)."""
    if _fires(KILL_ENV, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _fires(RAISE_ENV, rank, step):
        raise RuntimeError(f"{RAISE_ENV}: rank {rank} fails at step {step}")
    if _fires(HANG_ENV, rank, step):
        while True:  # never reaches the step's collectives; the others wait in them
            time.sleep(1)
    wait = os.environ.get(WAIT_ENV)
    if wait:
        world, at = (int(x) for x in wait.split(":"))
        while step == at and int(os.environ.get("WORLD_SIZE", "1")) < world:
            time.sleep(1)  # until the agent stops this worker to restart the job larger
