"""Process-group start-up from the environment that torchrun / the elastic agent sets."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from polytrain.backend.base import Accelerator
from polytrain.distributed import strict_collectives
from polytrain.distributed.collective_log import enable_collective_log
from polytrain.errors import PolytrainError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(acc: Accelerator) -> World:
    """Join the job described by RANK / WORLD_SIZE / LOCAL_RANK, or run as a single process.

    A process group is created only when there is more than one process, with the
    accelerator's collective library (gloo on CPU). Idempotent: a test or script
    that already initialised torch.distributed keeps its group.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), local_rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        enable_collective_log()  # before the groups exist: the hang watchdog reads it
        strict_collectives.install_if_enabled()  # POLYTRAIN_STRICT_COLLECTIVES: before any P2POp exists
        acc.set_device(local_rank)
        dist.init_process_group(backend=acc.dist_backend, timeout=timedelta(minutes=30))
        atexit.register(_destroy_at_exit)
        return World(dist.get_rank(), world_size, local_rank)
    return World(0, 1, local_rank)


def _destroy_at_exit() -> None:
    """Destroy the process group polytrain created if the program did not, while the
    interpreter is whole: left to interpreter teardown, gloo's threads can still hold pending
    work whose tensors need Python, and the finished job aborts (SIGABRT) on its way out.
    Skipped while an exception is ending the program: a peer may be mid-collective, and
    destroying under it could wait forever, where exiting lets the launcher see the failure."""
    if dist.is_initialized() and not is_failing():
        dist.destroy_process_group()


_failure_noted = False


def note_failure() -> None:
    """Mark this process as ending on a failure it caught itself (a worker's exit path reports
    the error and exits nonzero), so the exit handler leaves the group alone as for an
    uncaught exception."""
    global _failure_noted
    _failure_noted = True


def is_failing() -> bool:
    """Whether the program is ending on a failure: noted by `note_failure`, or an uncaught
    exception (Python sets sys.last_exc, or sys.last_value before 3.12, after printing its
    traceback and before atexit handlers)."""
    return (_failure_noted or getattr(sys, "last_exc", None) is not None
            or getattr(sys, "last_value", None) is not None)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def mean_over_world(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over all ranks (every rank holds a data-parallel replica's value)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def max_over_world(flag: torch.Tensor) -> torch.Tensor:
    """The largest value of `flag` on any rank (e.g. 1 if any rank saw an overflow)."""
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def together(fn: Callable[[], T] | None) -> T | None:
    """Run `fn` on this rank (None: nothing), then agree: if it raised a PolytrainError on any
    rank, raise one on every rank; else return its result. A collective, like a barrier.

    For work one rank does while the others wait (rank 0 tokenizing the corpus): at a plain
    barrier, the others would wait until the failed rank's exit tore the group down and then
    die in a gloo error with a traceback each, burying the one-line message. The failed rank
    re-raises its own error; the others raise the lowest failed rank's message.
    """
    error, result = None, None
    try:
        result = fn() if fn is not None else None
    except PolytrainError as e:
        error = e
    if dist.is_initialized():
        messages: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if error is None else str(error))
        first = next((m for m in messages if m is not None), None)
        if error is None and first is not None:
            raise PolytrainError(first)
    if error is not None:
        raise error
    return result
