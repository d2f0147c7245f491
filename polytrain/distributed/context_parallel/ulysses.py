"""DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence shards to head shards and back.

Before attention each of the U ranks holds all heads of T/U tokens; one all-to-all per
tensor gives it H/U heads of all T tokens, attention runs on whole sequences, and one
all-to-all brings the output back to the ranks' own tokens. Per rank and layer that is
4 all-to-alls in forward (q, k, v, out) and 4 in backward, each sending (U-1)/U of its
input.

Grouped-query attention: with Hkv divisible by U the key/value heads split like the query
heads; with U divisible by Hkv each key/value head is repeated U / Hkv times first, so
each rank receives the one its query heads read (query head h reads key head
h // (H / Hkv); rank i's query heads all read head i // (U / Hkv)). Its gradient sums the
copies.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from polytrain.distributed.collectives import all_to_all, group_size


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, H, t, D) this rank's tokens -> (B, H/U, U*t, D) its heads, tokens in group-rank order."""
    n = group_size(group)
    B, H, t, D = x.shape
    send = x.reshape(B, n, H // n, t, D).transpose(0, 1)  # (U, B, H/U, t, D): slot j -> rank j
    recv = all_to_all(send, group)  # slot j: rank j's tokens of this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, D)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, H/U, U*t, D) this rank's heads -> (B, H, t, D) its own tokens of every head."""
    n = group_size(group)
    B, h, T, D = x.shape
    send = x.reshape(B, h, n, T // n, D).permute(2, 0, 1, 3, 4)  # (U, B, H/U, t, D): slot j = rank j's tokens
    recv = all_to_all(send, group)  # slot j: this rank's tokens of rank j's heads
    return recv.transpose(0, 1).reshape(B, n * h, T // n, D)


class _Reshard(torch.autograd.Function):
    """Forward: sequence -> head shards (to_heads) or back; backward: the other direction."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, H, T/U, D) -> (B, H/U, T, D), differentiable (backward: the reverse all-to-all)."""
    return _Reshard.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, H/U, T, D) -> (B, H, T/U, D), differentiable."""
    return _Reshard.apply(x, group, False)


def kv_heads_for(n_kv: int, degree: int) -> int:
    """Key/value heads to send through the all-to-all: n_kv, or `degree` copies where n_kv < degree."""
    if n_kv % degree == 0:
        return n_kv
    if degree % n_kv == 0:
        return degree
    raise ValueError(f"Ulysses degree {degree} and {n_kv} key/value heads: one must divide the other")


def spread_kv(k: torch.Tensor, degree: int) -> torch.Tensor:
    """(B, Hkv, t, D) -> (B, kv_heads_for(Hkv, degree), t, D): key/value heads repeated where too few."""
    return k.repeat_interleave(kv_heads_for(k.shape[1], degree) // k.shape[1], dim=1)
