"""Asynchronous checkpoint saves: stage the state in host memory, write it in a background thread.

    writer = BackgroundWriter()
    staged = stage_to_host(tensors.state_dict())   # collective-free copy; training may go on
    writer.submit(lambda group: write_checkpoint_dir(..., staged, group=group))
    ...                                              # steps run while the thread writes
    writer.wait()                                    # the next save and the run's end call this

Why not torch's dcp.async_save: polytrain's save is more than DCP's (temporary directory,
every rank's RNG file, the manifest the ranks hash in turns, rank 0's rename): the whole of
`write_checkpoint_dir` runs in the thread, unchanged, so an async checkpoint is exactly as
atomic as a synchronous one and a crash mid-write leaves only a `.tmp-` directory.

Collectives: the thread's (DCP's planning, the error agreements, the hash gather) go over a
process group of their own (gloo: the staged tensors are on the host), made once on every rank
in the foreground. The default group's collectives (training's) and the writer's then never
interleave, on any backend, and the writer's are in the same order on every rank because at
most one save is in flight (`submit` waits for the previous one first).

Errors: an exception in the thread is kept and raised by the next `wait` (at the next save or
at the end of the run), never lost. Memory: staging holds one host copy of this rank's model
and optimizer shards (pinned when they live on an accelerator, so the copies run at DMA speed
and can overlap) until the write ends.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from polytrain.errors import CheckpointError


@torch.no_grad()
def stage_to_host(state: Any) -> Any:
    """A copy of a (nested) state dict whose tensors live in host memory and share nothing with
    `state`'s: training may then update its tensors in place. DTensors stay DTensors (DCP saves
    their shards at their global offsets); a tensor held under two names (tied weights) is copied
    once. Non-tensor values (steps, param_groups) are deep-copied."""
    copies: dict[int, Any] = {}
    on_device = [False]

    def host(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.detach().clone()
        on_device[0] = True
        # Pinned: the device-to-host copy is a DMA the device queues without waiting, one sync below.
        buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return buffer.copy_(t.detach(), non_blocking=True)

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                # A DTensor's .to("cpu") is one per-shard copy; on the host, clone is.
                copies[id(value)] = (value.detach().clone() if value.device.type == "cpu" else value.detach().to("cpu")
                                     ) if isinstance(value, DTensor) else host(value)
            return copies[id(value)]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return copy.deepcopy(value)

    staged = walk(state)
    if on_device[0]:
        torch.accelerator.synchronize()  # every non-blocking copy has landed before the thread reads it
    return staged


class BackgroundWriter:
    """At most one checkpoint write in flight, in a background thread, over its own process group."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None

    def _writer_group(self) -> Any:
        """The gloo group of the writer's collectives; None without a process group. Made on first
        use, which every rank reaches at the same save (new_group is itself collective)."""
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def submit(self, write: Callable[[Any], Any], name: str) -> None:
        """Wait for the previous write (raising its error), then run `write(group)` in a thread."""
        self.wait()
        group = self._writer_group()

        def run() -> None:
            try:
                write(group)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                self._error = e

        # A daemon: a run that dies of an error elsewhere is not kept alive by a write whose peers
        # are gone; the write it abandons stays a .tmp- directory, ignored and cleared.
        self._thread = threading.Thread(target=run, name=f"checkpoint-{name}", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the write in flight (if any) ends; raise its error, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"the background checkpoint save failed: {error}") from error
