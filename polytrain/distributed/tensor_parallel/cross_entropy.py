"""Cross-entropy over vocabulary-parallel logits: the full (B, T, V) never exists on one rank.

Rank r holds logits for vocabulary rows [start, end) (shard_range). Per token:

    loss = log sum_v exp(z_v - m) - (z_target - m),   m = max_v z_v

The max is all-reduced (MAX) over tp; the local sums of exp and the target's shifted
logit (found on exactly one rank, zero on the others) are all-reduced (SUM) together.
Backward needs no communication: d loss / d z_v = softmax_v - [v == target], and each
rank holds its own rows of the softmax. Every rank ends with the same loss.

Targets of -100 (IGNORE, F.cross_entropy's ignore_index: BERT's unmasked positions,
T5's padding) are not scored: the mean runs over the scored tokens only, as
F.cross_entropy's does, and their logits get no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from polytrain.distributed.collectives import all_reduce
from polytrain.distributed.tensor_parallel.shards import shard_range

IGNORE = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token losses (N,) from local logits (N, V_local) and targets (N,).

    Backward: (softmax_local - one_hot_local) * grad, no communication.
    """

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        n_local = logits.shape[-1]
        if n_local:
            local_max = logits.max(-1).values  # (N,)
        else:  # an empty vocabulary shard
            local_max = logits.new_full(targets.shape, float("-inf"))
        shifted = logits - all_reduce(local_max, group, op=dist.ReduceOp.MAX)[:, None]  # (N, V_local)
        exp = shifted.exp()
        local_target = targets - start
        inside = (local_target >= 0) & (local_target < n_local)  # (N,) the target is one of my rows
        index = local_target.clamp(0, max(n_local - 1, 0))[:, None]  # (N, 1)
        target_logit = shifted.gather(-1, index)[:, 0] if n_local else torch.zeros_like(local_max)
        target_logit = target_logit.masked_fill(~inside, 0.0)
        # One all-reduce for both per-token sums: (2, N)
        sum_exp, target_logit = all_reduce(torch.stack([exp.sum(-1), target_logit]), group).unbind(0)
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, index, inside)
        return sum_exp.log() - target_logit  # (N,)

    @staticmethod
    def backward(ctx, grad):
        softmax, index, inside = ctx.saved_tensors
        grad_logits = softmax * grad[:, None]  # (N, V_local)
        if grad_logits.shape[-1]:
            grad_logits.scatter_add_(-1, index, -(grad * inside)[:, None])
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group) -> torch.Tensor:
    """Mean cross-entropy of local logits (B, T, V_local), rows from `vocab_start`, and targets (B, T),
    over the tokens whose target is not IGNORE (NaN when none is, as F.cross_entropy)."""
    targets = targets.flatten()
    losses = _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets, vocab_start, group)  # (N,)
    scored = targets != IGNORE
    return torch.where(scored, losses, 0.0).sum() / scored.sum()


def vocab_parallel_loss(mesh: DeviceMesh, vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The trainer's loss_fn under tp: (logits (B, T, V/tp), targets (B, T)) -> scalar, equal on all tp ranks."""
    start, _ = shard_range(vocab_size, mesh.size(), mesh.get_local_rank())
    group = mesh.get_group()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, start, group)

    return loss_fn
