"""Start N local workers through torch's elastic launcher (what torchrun uses).

`polytrain train --parallel.nproc N` re-runs itself as N workers of
`python -m polytrain.train`, and `polytrain run --nproc N SCRIPT` as N workers of
`python -m polytrain.compat SCRIPT`, each with RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE set; under `torchrun` the same modules are started directly, on any number
of nodes.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

EXIT_USER_ERROR = 2
LAUNCHED_ENV = "POLYTRAIN_LAUNCHED"  # set for workers this launcher starts: the parent already spoke


def launch_local_workers(nproc: int, argv: list[str], module: str = "polytrain.train") -> int:
    """Run `python -m MODULE ARGV` as `nproc` workers on this machine; returns an exit code."""
    # Each worker would otherwise start one thread per core and they would fight
    # over the cores; torchrun applies the same default.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHED_ENV] = "1"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"polytrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    try:
        with _quiet_agent():
            elastic_launch(config, sys.executable)("-u", "-m", module, *argv)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        if EXIT_USER_ERROR in codes.values():
            return EXIT_USER_ERROR  # the worker already printed the one-line reason
        rank, code = min(codes.items())
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(f"error: worker {rank} {how}; its output is above", file=sys.stderr)
        return 1
    return 0


@contextmanager
def _quiet_agent() -> Iterator[None]:
    """Hold back the elastic agent's own ERROR lines ("failed (exitcode: 2) local_rank: 0 ...").

    A failed worker has already said why (a user error in one `error:` line, a crash in its
    traceback) and the caller adds which worker exited how; the agent's line would only be a
    second, rawer copy. Its loggers each carry their own level, so each is raised.
    """
    loggers = [logger for name, logger in logging.Logger.manager.loggerDict.items()
               if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
