"""How a worker process ends: its exit code, and nothing after it that can abort.

A worker that has finished (every rank reported, process groups destroyed) can still die
at interpreter shutdown: C++ objects that outlive Python (gloo's and the inductor compile
pool's threads, tensors held by pending work) are torn down during finalization, and one
destroyed while its thread is still joinable calls std::terminate ("terminate called
without an active exception", SIGABRT, exit 1 after a run that succeeded). So a worker
does the orderly part of shutdown itself, while the interpreter is whole, and then leaves
with os._exit, which skips only the teardown that aborts:

  1. threading's exit hooks run and non-daemon threads are joined (Python's own first step),
  2. atexit handlers run (the program's, logging's flush, torch's own),
  3. the default process group, if still live, is destroyed - on success only,
  4. stdout and stderr are flushed, then os._exit(code).

One rule for the group on every path (here and `distributed.world`'s exit handler): destroyed
when the work succeeded, left alone when it failed. A failing rank's peers may be inside a
collective that destroying could wait on forever; os._exit ends the process either way, and
the peers' collectives then fail, which is what lets the launcher see the failure.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from polytrain.distributed.world import note_failure
from polytrain.errors import PolytrainError
from polytrain.train.launch import EXIT_USER_ERROR


def exit_code(error: SystemExit) -> int:
    """The code `sys.exit(x)` asks for, as Python's own shutdown would report it."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


def run_rank(work: Callable[[], list[str]]) -> int:
    """One rank's job (training, RLHF): `work` returns its summary lines; returns the exit code.

    Rank 0 logs what it is doing and prints the summary; the others stay quiet. A
    PolytrainError (bad input, a refused checkpoint) is one `error:` line from rank 0 and
    EXIT_USER_ERROR; anything else propagates to run_and_exit, which prints its traceback.
    On success the process group is destroyed before the summary is printed; on a failure
    it is left for os._exit (see the module docstring).
    """
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        lines = work()
    except PolytrainError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR  # run_and_exit's finish notes the failure, for any nonzero code
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        print("\n".join(lines), flush=True)
    return 0


def keep_lines_whole() -> None:
    """Make each line a worker prints one write. Launched workers run `python -u`, where print's
    text and its newline are two writes, so two ranks printing at once on a shared pipe can
    interleave mid-line; buffered up to each newline (and any explicit flush, which progress
    bars do) a line stays whole and output stays as prompt."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(write_through=False, line_buffering=True)


def run_and_exit(main: Callable[[], int]) -> NoReturn:
    """Run a worker's `main` (returning its exit code) and end the process with that code.

    Its output is line-buffered (`keep_lines_whole`). A SystemExit gives its code; any other
    exception prints its traceback, as an uncaught one would, and exits 1.
    """
    keep_lines_whole()
    try:
        code = main()
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:  # noqa: BLE001 (reported as Python would, then the same orderly exit)
        traceback.print_exc()
        code = 1
    finish(code)


def finish(code: int) -> NoReturn:
    if code != 0:
        note_failure()  # atexit's group handler then leaves the group too
    # The interpreter's own first step at exit: threading's exit hooks (concurrent.futures tells
    # its pools' idle workers to stop), then every non-daemon thread joined.
    threading._shutdown()
    try:
        atexit._run_exitfuncs()
    finally:
        try:
            if code == 0 and dist.is_initialized():
                dist.destroy_process_group()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
                    pass
            os._exit(code)
