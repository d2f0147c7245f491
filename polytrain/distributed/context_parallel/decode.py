"""Long-context inference over a cp group: a KV cache split like the sequence, and decoding over it.

Prefill runs the prompt sharded by the layout, through the training path (ring / Ulysses
attention), and each rank's cache keeps the keys and values of its own slots: a prompt
whose cache would not fit one rank's memory fits P of them. Decoding then feeds the same
new token to every rank. Its key and value go to one rank's cache (generated slot s to cp
rank s mod P, so the caches keep growing evenly), and its query attends to each rank's
shard locally, giving a partial output and log-sum-exp; one all-gather of those partials
(B x H x (D + 1) numbers per rank) and the LSE merge give every rank the same output.
"""

from __future__ import annotations

from typing import Protocol

import torch

from polytrain.distributed.collectives import all_gather
from polytrain.distributed.context_parallel.layout import CPGroups
from polytrain.models.common.blockwise_attention import Visibility, attention_forward
from polytrain.models.common.kv_cache import KVCache


class Decoding(Protocol):
    """What the cache reads of a ContextParallel (attention.py): its groups, and whether it is decoding."""

    groups: CPGroups
    decoding: bool


class ShardedKVCache(KVCache):
    """This rank's part of a KV cache over the cp group: its prompt slots, then every P-th new token.

    While `cp.decoding` is False (prefill) all of k is this rank's shard of the prompt; after,
    each call brings one token, kept by its owner only.
    """

    def __init__(self, batch_size: int, local_max_len: int, cp: Decoding):
        super().__init__(batch_size, local_max_len)
        self.cp = cp
        self._filled: dict[int, int] = {}  # layer -> slots of this rank's cache in use

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep k, v (B, Hkv, T, D) where they belong; return this rank's whole shard (B, Hkv, S_local, D)."""
        if layer not in self._kv:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self._kv[layer] = (k.new_zeros(shape), v.new_zeros(shape))
        cache_k, cache_v = self._kv[layer]
        n = self._filled.get(layer, 0)
        groups = self.cp.groups
        mine = not self.cp.decoding or start_pos % groups.size == groups.cp_rank
        if mine:
            end = n + k.shape[2]
            if end > self.max_len:
                raise ValueError(f"this rank's KV cache shard holds {self.max_len} positions; writing up to {end}")
            cache_k[:, :, n:end], cache_v[:, :, n:end] = k, v
            self._filled[layer] = n = end
        return cache_k[:, :, :n], cache_v[:, :, :n]

    def filled(self, layer: int = 0) -> int:
        """Slots of `layer` this rank holds."""
        return self._filled.get(layer, 0)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     groups: CPGroups) -> torch.Tensor:
    """q (B, H, 1, D), the same on every rank, over every rank's cached k, v (B, Hkv, S_r, D) -> (B, H, 1, D)."""
    n_keys = k.shape[2]
    everything = Visibility(False, torch.zeros(1, dtype=torch.long), torch.zeros(n_keys, dtype=torch.long))
    out, lse = attention_forward(q, k, v, everything, scale)  # partial, over this rank's keys
    if groups.size == 1:
        return out.to(q.dtype)
    outs = all_gather(out[None], 0, groups.cp)  # (P, B, H, 1, D)
    lses = all_gather(lse[None], 0, groups.cp)  # (P, B, H, 1)
    total = torch.logsumexp(lses, dim=0)  # (B, H, 1)
    safe = total.masked_fill(total == float("-inf"), 0.0)
    weights = torch.exp(lses - safe)  # each shard's share of the softmax mass
    return (outs * weights[..., None]).sum(0).to(q.dtype)
