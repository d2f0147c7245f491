"""Test hooks that make one rank fail at a chosen step, as real faults would (off unless set).

    POLYTRAIN_TEST_HANG="RANK:STEP[:ATTEMPT]"   that rank stops before the step's collectives
    POLYTRAIN_TEST_KILL="RANK:STEP[:ATTEMPT]"   that rank SIGKILLs itself at the start of the step

ATTEMPT (default 0) is the elastic restart count (TORCHELASTIC_RESTART_COUNT) the fault
fires in, so a restarted job runs on.
"""

from __future__ import annotations

import os
import signal
import time

HANG_ENV = "POLYTRAIN_TEST_HANG"
KILL_ENV = "POLYTRAIN_TEST_KILL"


def _fires(env: str, rank: int, step: int) -> bool:
    value = os.environ.get(env)
    if not value:
        return False
    parts = [int(x) for x in value.split(":")]
    attempt = parts[2] if len(parts) > 2 else 0
    return (parts[0], parts[1]) == (rank, step) and attempt == int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def inject_faults(rank: int, step: int) -> None:
    """Hang or die here if a test asked this rank to at this step (see the module docstring)."""
    if _fires(KILL_ENV, rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _fires(HANG_ENV, rank, step):
        while True:  # never reaches the step's collectives; the others wait in them
            time.sleep(1)
