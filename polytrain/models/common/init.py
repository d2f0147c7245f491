"""Sharding-independent parameter initialization.

Each parameter is drawn in full, in fp32 on CPU, from its own generator seeded by
(run seed, parameter name). The values therefore depend neither on the order in
which parameters are visited nor on how they are later split across devices:
a sharded materializer draws the same full tensor and keeps its slice.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import torch
import torch.nn as nn


class Initializable(Protocol):
    """What a model provides so that it can be initialized parameter by parameter."""

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None: ...

    def init_buffers(self) -> None: ...


def seed_for(seed: int, name: str) -> int:
    """Generator seed (32 bits) for parameter `name` under run seed `seed`."""
    # A CPU torch.Generator keeps only the low 32 bits of its seed, so seed and
    # name are hashed together into 32 bits (crc32 rather than hash(): that one is
    # salted per process).
    return zlib.crc32(f"{seed}:{name}".encode())


def init_plain(model: nn.Module, seed: int) -> None:
    """Initialize every parameter of a model whose parameters are plain tensors, then its buffers.

    `model` must implement `Initializable`. Tied parameters are initialized once,
    under their first name.
    """
    init: Initializable = model  # type: ignore[assignment]
    with torch.no_grad():
        for name, param in model.named_parameters():  # duplicates (tied) are skipped
            full = torch.empty(param.shape, dtype=torch.float32)
            init.init_parameter(name, full, torch.Generator().manual_seed(seed_for(seed, name)))
            param.copy_(full)
    init.init_buffers()
