"""The shared multi-rank test helper: run a function on N ranks in fresh processes, each bound to
its device and joined with the collective library of the accelerator polytrain's backend layer
picks (gloo on the CPU; POLYTRAIN_ACCELERATOR=<name> selects another, tests/device).

    def _body(rank, world_size, arg): ...          # module level, so it can be pickled
    results = run_ranks(4, _body, arg)             # one result per rank, rank order

A rank that raises fails the calling test with that rank's traceback.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    if os.environ.get("POLYTRAIN_TEST_COMPAT_SHIM") == "1":  # pytest --compat-shim
        from polytrain.backend.compat import install

        install()
    torch.set_num_threads(1)  # N ranks share this machine's cores
    from polytrain.distributed import strict_collectives

    strict_collectives.install_if_enabled()  # tests/conftest.py turns it on for every test
    try:
        from polytrain.backend import get_accelerator

        acc = get_accelerator()
        acc.set_device(rank)  # as polytrain's init_world binds a launched rank
        dist.init_process_group(acc.dist_backend, rank=rank, world_size=world_size)
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not failures:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead:
                failures.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            elif time.monotonic() > deadline:
                failures.append(f"timed out after {timeout}s")
            continue
        if ok:
            results[rank] = value
        else:
            failures.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=5 if failures else timeout)
        if p.is_alive():
            p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def make_runtime(dims):
    """The Runtime of layout `dims` for this process (a rank of run_ranks, or a single process)."""
    from polytrain.backend import get_accelerator
    from polytrain.distributed.runtime import Runtime
    from polytrain.distributed.world import init_world

    acc = get_accelerator()
    return Runtime.create(acc, init_world(acc), dims)


def tp_parallelize(model, dims):
    """Apply `model`'s architecture plan over layout `dims` (tests' shortcut); (tp context, mesh)."""
    from polytrain.distributed.tensor_parallel import parallelize_model
    from polytrain.models import ARCHITECTURES

    runtime = make_runtime(dims)
    plan = ARCHITECTURES[model.cfg.arch].tp_plan(model.cfg) if dims.tp > 1 else None
    return parallelize_model(model, plan, runtime), runtime.mesh
