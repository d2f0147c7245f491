"""Which samples each data-parallel rank trains on, resumable at the exact sample.

The global sample stream is the same whatever the number of ranks: epoch e is a random
permutation of all samples, seeded from (seed, e), and the stream is epoch 0, epoch 1, ...
Optimizer step k consumes stream positions [k*G, (k+1)*G) for G = global_batch_size, and
rank r of dp_size takes the contiguous slice [r*G/dp, (r+1)*G/dp) of them.

The state is one counter of consumed positions, so a checkpoint written with 2 ranks
resumes with 1 (or 4) ranks on exactly the samples that come next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sized
from typing import Any

import torch

from polytrain.errors import ConfigError


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for one epoch; hashing keeps (s, e+1) and (s+1, e) unrelated."""
    digest = hashlib.sha256(f"polytrain-sampler/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GlobalBatchSampler:
    """Hands this rank its dataset indices for each optimizer step; see the module docstring."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        if num_samples <= 0:
            raise ValueError(f"num_samples = {num_samples} must be positive")
        if global_batch_size <= 0 or global_batch_size % dp_size:
            raise ValueError(f"global_batch_size = {global_batch_size} must be a positive "
                             f"multiple of dp_size = {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} is outside [0, {dp_size})")
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0  # stream positions used by all ranks together so far
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed // self.num_samples

    def _permutation(self, epoch: int) -> torch.Tensor:
        # Only the current epoch is kept: the stream is read forward, at most one boundary per step.
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(self.num_samples, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def _take(self, start: int, count: int) -> list[int]:
        """Dataset indices at stream positions [start, start + count)."""
        out: list[int] = []
        while count:
            epoch, offset = divmod(start, self.num_samples)
            n = min(count, self.num_samples - offset)
            out += self._permutation(epoch)[offset : offset + n].tolist()
            start, count = start + n, count - n
        return out

    def next_batch(self) -> list[int]:
        """This rank's global_batch_size / dp_size dataset indices for the next step."""
        per_rank = self.global_batch_size // self.dp_size
        batch = self._take(self.consumed + self.dp_rank * per_rank, per_rank)
        self.consumed += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """Everything needed to continue the stream; the same on every rank and for any dp_size."""
        return {"consumed": self.consumed, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the sample after the last one `state` consumed (its seed wins)."""
        if state["num_samples"] != self.num_samples:
            raise ConfigError(
                f"the checkpoint's data order covers {state['num_samples']} samples but the data "
                f"now has {self.num_samples}; data.source, data.seq_len or the tokenizer changed. "
                "Resume with the same data, or start fresh with --checkpoint.resume none"
            )
        if state["global_batch_size"] != self.global_batch_size:
            raise ConfigError(
                f"the checkpoint was trained with train.global_batch_size = "
                f"{state['global_batch_size']}, not {self.global_batch_size}; keep it when resuming"
            )
        self.seed, self.consumed = state["seed"], state["consumed"]
        self._perm_epoch = -1


def val_batches(dataset: Sized, micro_batch_size: int, n_batches: int,
                dp_rank: int = 0, dp_size: int = 1) -> list[list[int]]:
    """This rank's fixed validation micro-batches: n_batches lists of micro_batch_size indices.

    All ranks together read samples 0, 1, 2, ... in order (micro-batch b of rank r is
    positions [(b*dp + r)*mbs, (b*dp + r + 1)*mbs)), wrapping around a validation set that
    is smaller than n_batches * micro_batch_size * dp_size, so every rank runs the same number
    of batches.
    """
    n = len(dataset)
    if n == 0:
        raise ValueError("validation set holds no samples")
    step = micro_batch_size * dp_size
    first = dp_rank * micro_batch_size
    return [[(b * step + first + j) % n for j in range(micro_batch_size)] for b in range(n_batches)]
