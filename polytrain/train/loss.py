"""Which loss a model trains with: the chunked head, the vocabulary-parallel loss, or plain logits.

    chunked = attach_loss_head(meta_model, cfg.train, dims)     # before the pipeline split
    ... split, parallelize ...
    head = scoring_head(stages, pipeline, backend) if chunked else None   # after tensor parallelism
    loss = ModelLoss(logits_loss_for(tp_ctx, vocab_size), head)
    value = loss(model, args, targets)                           # a micro-batch's mean loss

- The chunked head (chunked_loss.py) replaces the output Linear, with the same parameters:
  the model then returns the mean loss itself and the (tokens, vocabulary) logits never
  exist whole. Under tensor parallelism (1d) the plan turns it into the vocabulary-parallel
  head, which scores the same way on its vocabulary rows; on a pipeline's last stage it
  hands the schedule its input and `ModelLoss.logits_loss` scores that.
- Without it (train.chunked_loss false, the 2d/2.5d/3d grids): logits, scored by the tp
  context's vocabulary-parallel cross-entropy under tp, plain cross-entropy otherwise.
- Under context parallelism (`ContextParallelLoss`) each rank scores its shard of every
  sequence: its mean times (its scored tokens x cp / the cp group's), so the cp ranks'
  losses average to the micro-batch's mean over all its tokens (never a mean of means),
  and the gradient average over dp x cp is the single process's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.config import TrainConfig
from polytrain.distributed.collectives import all_reduce
from polytrain.distributed.context_parallel import ContextParallel
from polytrain.distributed.context_parallel.apply import begin_batch
from polytrain.distributed.topology import ParallelDims
from polytrain.train.chunked_loss import IGNORE_INDEX, LossHead, ScoringHead

LogitsLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def attach_loss_head(model: nn.Module, t: TrainConfig, dims: ParallelDims) -> bool:
    """Replace `model.output` (on the meta device) by the chunked loss head where it applies
    (train.chunked_loss, not a 2d/2.5d/3d grid); whether it did."""
    if not t.chunked_loss or (dims.tp > 1 and dims.tp_mode != "1d"):
        return False
    model.output = LossHead.replacing(model.output)
    return True


def scoring_head(stages: dict[str, nn.Module], pipeline, compile_backend: str | None) -> ScoringHead | None:
    """The parallelized head of the stage holding it (None on a pipeline rank without the last
    stage); on a pipeline it is deferred: the schedule's loss calls it on the stage's output.
    `compile_backend` (train.compile): the head's per-chunk softmax kernels are compiled with it."""
    last = str(pipeline.num_stages - 1) if pipeline else ""
    if last not in stages:
        return None
    head = stages[last].output  # a LossHead, or tp's VocabParallelHead made from it
    head.deferred = pipeline is not None
    head.compile_backend = compile_backend
    return head


def deferred_loss(head: ScoringHead, autocast: Callable[[], ContextManager]) -> LogitsLoss:
    """A pipeline's last-stage loss: (the stage's output, hidden states (B, T, D), targets) -> mean
    loss, the head's matmuls in the stages' precision."""
    def loss(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast():
            return head.loss(hidden, targets)

    return loss


def logits_loss_for(tp_ctx, vocab_size: int) -> LogitsLoss:
    """The loss on the model's logits: vocabulary-parallel under tp (its context's), else plain."""
    return tp_ctx.loss_fn(vocab_size) if tp_ctx is not None else causal_lm_loss


@dataclass(frozen=True)
class ModelLoss:
    """The mean loss of a micro-batch: `loss(model, args, targets)`, targets -100 where unscored."""

    logits_loss: LogitsLoss
    """(logits, targets) -> mean loss; also what a pipeline's last stage computes (from its
    output: logits, or a deferred head's hidden states)."""
    head: ScoringHead | None = None
    """The chunked head, when the model scores its own output chunk by chunk."""

    def __call__(self, model: nn.Module, args: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        if self.head is not None and not self.head.deferred:
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
        if self.inner.head is None or self.inner.head.deferred:  # logits (or a stage's output) scored
            return self.inner(model, [self.cp.shard(tokens), *args[1:]], local)
        mean = self.inner(model, [self.cp.shard(tokens), *args[1:]], _never_empty(local))
        return shard_weighted(mean, local, self.cp)
