"""Frozen step-3 models in host memory while idle (rlhf.offload_reference, rlhf.offload_reward).

    idle = IdleOffload(role.model, role.runtime)   # parks the parameters in host memory
    with idle.resident(): role.logprobs(ids)       # on the device for the pass, parked again after

The reference and the reward model each run one no-grad pass per step and sit idle during
generation and training, when the actor's gathered copy, its KV cache and the activations
need the room. Parking works on the parameters' storages, as FSDP2 frees an unsharded
unit: the bytes are copied to a host buffer (page-locked where the accelerator supports
it) and the device storage is resized to 0; coming back resizes it and copies the bytes
in. Every tensor object and view stays (a ZeRO-3 shard is a view of FSDP's flat buffer),
so the model computes exactly what it did. Where the device is host memory (a CPU run)
there is nowhere to move to: the same calls run and count, and no bytes are copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from polytrain.distributed.runtime import Runtime

HOST = torch.device("cpu")

Parked = list[tuple[torch.UntypedStorage, torch.Tensor]]
"""(the emptied device storage, its bytes in host memory) per storage."""


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor (nbytes,) over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def park(tensors: Iterable[torch.Tensor], pin: bool = False) -> Parked:
    """Copy each distinct storage of `tensors` to host memory and free it on the device."""
    parked: Parked = []
    seen: set[int] = set()
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, device=HOST, pin_memory=pin)
        host.copy_(_bytes(storage))
        storage.resize_(0)
        parked.append((storage, host))
    return parked


def unpark(parked: Parked) -> None:
    """Give each parked storage its device memory and bytes back."""
    for storage, host in parked:
        storage.resize_(host.numel())
        _bytes(storage).copy_(host)


class IdleOffload:
    """One frozen model's parameters, parked in host memory except inside `resident()`."""

    def __init__(self, model: nn.Module, runtime: Runtime, copies: bool | None = None):
        """copies: park the bytes (default: unless the device is host memory; True lets a CPU test run the path)."""
        self.model = model
        self.moves = 0
        """Times the model was parked (calls, also where nothing is copied): for tests and logs."""
        self.copies = runtime.device.type != HOST.type if copies is None else copies
        self.pin = runtime.acc.pin_memory_available()
        self._parked: Parked | None = None
        self.to_host()

    def to_host(self) -> None:
        self.moves += 1
        if self.copies and self._parked is None:
            self._parked = park(self.model.parameters(), self.pin)

    def to_device(self) -> None:
        if self._parked is not None:
            unpark(self._parked)
            self._parked = None

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The model on the device for the block, parked again after it."""
        self.to_device()
        try:
            yield
        finally:
            self.to_host()
