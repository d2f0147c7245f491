"""The futex that waiting shared-memory ranks sleep on (backend/futex.py)."""

import threading
import time

import pytest
import torch

from polytrain.backend import futex

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="futexes are used on x86-64 Linux only")


def test_a_sleeper_runs_once_the_word_is_written_and_woken():
    word = torch.zeros(2, dtype=torch.int64)  # as host_collectives' flags: the low half of an int64
    seen = []

    def sleeper():
        while int(word[1]) < 7:
            futex.wait(word.data_ptr() + 8, int(word[1]), timeout_s=60.0)
        seen.append((time.monotonic(), time.thread_time()))

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.2)  # asleep in the kernel by now (a later start finds 7 and returns at once)
    assert thread.is_alive() and not seen
    word[1] = 7
    written = time.monotonic()
    futex.wake(word.data_ptr() + 8)
    thread.join(timeout=30)
    (woke, cpu_s), = seen
    assert not thread.is_alive() and woke - written < 30  # woken, not its 60 s timeout
    assert cpu_s < 0.1  # it slept: a loop of returns at once would have spun for the 0.2 s


def test_wait_returns_at_once_where_the_word_already_differs_and_after_its_timeout():
    word = torch.tensor([5], dtype=torch.int64)
    start = time.monotonic()
    futex.wait(word.data_ptr(), 4, timeout_s=60.0)  # holds 5, not 4
    futex.wait(word.data_ptr(), 5, timeout_s=0.05)  # nobody wakes it
    assert time.monotonic() - start < 30
    big = torch.tensor([2**32 + 3], dtype=torch.int64)  # only the low 32 bits are compared
    futex.wait(big.data_ptr(), 3 + 2**32, timeout_s=0.05)
