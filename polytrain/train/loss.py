"""Which loss a model trains with: the chunked head, the vocabulary-parallel loss, or plain logits.

    head = attach_loss_head(meta_model, cfg.train, dims, pipelined)   # before parallelizing
    ... parallelize ...
    loss = ModelLoss(logits_loss_for(tp_ctx, vocab_size), head)
    value = loss(model, args, targets)                                 # a micro-batch's mean loss

- The chunked head (chunked_loss.py) replaces the output Linear, with the same parameters,
  where one rank holds the whole head: the model then returns the mean loss itself and the
  (tokens, vocabulary) logits never exist whole.
- Under tensor parallelism the head's logits are vocabulary-split and the tp context's
  vocabulary-parallel cross-entropy scores them; a pipeline's last stage scores logits too.
- Under context parallelism (`ContextParallelLoss`) each rank scores its shard of every
  sequence: its mean times (its scored tokens x cp / the cp group's), so the cp ranks'
  losses average to the micro-batch's mean over all its tokens (never a mean of means),
  and the gradient average over dp x cp is the single process's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.config import TrainConfig
from polytrain.distributed.collectives import all_reduce
from polytrain.distributed.context_parallel import ContextParallel
from polytrain.distributed.context_parallel.apply import begin_batch
from polytrain.distributed.topology import ParallelDims
from polytrain.train.chunked_loss import IGNORE_INDEX, LossHead

LogitsLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def attach_loss_head(model: nn.Module, t: TrainConfig, dims: ParallelDims, pipelined: bool) -> LossHead | None:
    """Replace `model.output` by the chunked loss head where it applies (train.chunked_loss, one
    rank holding the whole head: no tp, no pipeline); the head, or None."""
    if not t.chunked_loss or pipelined or dims.tp > 1:
        return None
    model.output = LossHead.replacing(model.output)
    return model.output


def logits_loss_for(tp_ctx, vocab_size: int) -> LogitsLoss:
    """The loss on the model's logits: vocabulary-parallel under tp (its context's), else plain."""
    return tp_ctx.loss_fn(vocab_size) if tp_ctx is not None else causal_lm_loss


@dataclass(frozen=True)
class ModelLoss:
    """The mean loss of a micro-batch: `loss(model, args, targets)`, targets -100 where unscored."""

    logits_loss: LogitsLoss
    """(logits, targets) -> mean loss; also what a pipeline's last stage computes."""
    head: LossHead | None = None
    """The chunked head, when the model scores its own output chunk by chunk."""

    def __call__(self, model: nn.Module, args: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            with self.head.scoring(targets):
                return model(*args)  # the head returns the mean loss, no (B, T', V) logits
        return self.logits_loss(model(*args), targets)  # logits (B, T', V or V/tp)


def shard_weighted(mean: torch.Tensor, targets: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """A rank's mean loss over its shard's scored `targets` -> its share x cp of the group's mean."""
    if cp.groups.size == 1:  # the shard is the whole sequence
        return mean
    scored = (targets != IGNORE_INDEX).sum().float()
    total = all_reduce(scored, cp.groups.cp).clamp(min=1.0)  # the whole sequences' scored tokens
    return mean * (scored * cp.groups.size / total)


def _never_empty(targets: torch.Tensor) -> torch.Tensor:
    """`targets` with its first entry scored (id 0) when nothing is: the mean is then finite and
    shard_weighted multiplies it by 0, where a mean over no token would be NaN. No host sync."""
    flat = targets.reshape(-1).clone()
    flat[0] = torch.where((flat != IGNORE_INDEX).any(), flat[0], torch.zeros_like(flat[0]))
    return flat.view_as(targets)


def sharded_logits_loss(logits_loss: LogitsLoss, cp: ContextParallel) -> LogitsLoss:
    """`logits_loss` on this rank's shard (logits (B, T/P, V), targets (B, T/P)), weighted by shard_weighted."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return shard_weighted(logits_loss(logits, _never_empty(targets)), targets, cp)
    return loss


@dataclass(frozen=True)
class ContextParallelLoss:
    """ModelLoss on this rank's shard of each sequence: model input, targets, positions, document ids.

    `inner.logits_loss` is already sharded_logits_loss's (a pipeline's last stage calls it);
    `eot_id`: packed documents end at this token (None: one document per row).
    """

    inner: ModelLoss
    cp: ContextParallel
    eot_id: int | None = None

    @property
    def logits_loss(self) -> LogitsLoss:
        return self.inner.logits_loss

    def __call__(self, model: nn.Module, args: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        tokens = args[0]  # (B, T) whole sequences; every cp rank read the same ones
        begin_batch(self.cp, tokens, self.eot_id)
        local = self.cp.shard(targets)
        if self.inner.head is None:
            return self.inner(model, [self.cp.shard(tokens), *args[1:]], local)
        mean = self.inner(model, [self.cp.shard(tokens), *args[1:]], _never_empty(local))
        return shard_weighted(mean, local, self.cp)
