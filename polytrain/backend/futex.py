"""Sleep until a 32-bit word of shared memory changes, and wake its sleepers: Linux's futex.

A rank of host_collectives.py waiting for a peer's flag either polls (taking a core) or
sleeps; a timed nap wakes late by up to its length after the peer arrived, and on a host
whose ranks outnumber the cores every wait is such a nap. A futex sleeps in the kernel until
the publishing rank wakes it (or the timeout passes), so the waiter runs again as soon as
the flag is written: what gloo gets from its blocking socket reads.

Used on x86-64 Linux only (the system call number is the architecture's); elsewhere
`AVAILABLE` is False and the caller naps.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall  # ctypes releases the GIL around it
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_call = _syscall()
AVAILABLE = _call is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at `address` holds `expected` (its low 32 bits), until woken or
    `timeout_s` passes; returns at once where the word already differs. Spurious returns are
    allowed: the caller looks at the word again."""
    seconds = int(timeout_s)
    timeout = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
    _call(ctypes.c_long(_SYS_FUTEX_X86_64), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAIT),
          ctypes.c_int(expected & 0xFFFFFFFF), ctypes.byref(timeout), ctypes.c_void_p(None), ctypes.c_int(0))


def wake(address: int) -> None:
    """Wake every process sleeping in `wait` on the int32 at `address`."""
    _call(ctypes.c_long(_SYS_FUTEX_X86_64), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
          ctypes.c_int(_WAKE_ALL), ctypes.c_void_p(None), ctypes.c_void_p(None), ctypes.c_int(0))
