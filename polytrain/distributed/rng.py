"""Random streams for dropout under model parallelism.

Where an activation is replicated over the tensor-parallel ranks (the residual stream
of plain tensor parallelism), every rank must drop the same elements, or the replicas
drift apart. Where it is sharded (attention heads; the residual stream under sequence
parallelism) each rank holds different elements and must draw independent masks, or
the shards' masks are correlated copies of each other. Different data-parallel ranks
and pipeline stages always draw independently.

`fork(sharded)` runs a block of code on a generator derived from two things:

- one 32-bit draw from the current default generator, which every rank of a
  tensor-parallel group advances in lock-step (the trainer seeds every rank with
  run.seed, and they run the same code on the same shapes outside sharded forks), and
- this rank's key: its mesh coordinates without tp (`sharded=False`) or with tp
  (`sharded=True`).

Nothing else is stored, so activation checkpointing needs no help: torch's checkpoint
saves and restores the default generator around the recomputed code, which then draws
the same value and therefore the same masks. The default generator is restored when the
fork ends, so the code around it sees no difference whatever the fork consumed.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import torch

from polytrain.backend.base import Accelerator


class DropoutRNG:
    """Forks of the default generator keyed by this rank's place in the layout."""

    def __init__(self, acc: Accelerator, coordinates: dict[str, int], sharded_axis: str = "tp"):
        """`coordinates`: this rank's mesh coordinates; `sharded_axis`: the axis whose ranks hold different shards."""
        self.acc = acc
        replicated = {k: v for k, v in coordinates.items() if k != sharded_axis}
        self.keys = {False: _key(replicated), True: _key(coordinates)}

    @contextlib.contextmanager
    def fork(self, sharded: bool) -> Iterator[None]:
        """Run the block on a generator private to this rank (sharded) or shared with its tp group."""
        draw = int(torch.randint(0, 2**31, (1,)).item())  # advances the default generator by one draw
        seed = zlib.crc32(f"{draw}:{self.keys[sharded]}".encode())  # CPU generators keep 32 bits
        cpu_state, device_state = torch.get_rng_state(), self.acc.get_rng_state()
        torch.random.default_generator.manual_seed(seed)
        self.acc.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_state)
            self.acc.set_rng_state(device_state)


def _key(coordinates: dict[str, int]) -> int:
    return zlib.crc32(",".join(f"{k}={v}" for k, v in sorted(coordinates.items())).encode())
