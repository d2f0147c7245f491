"""Which loss a model trains with: the chunked head, the vocabulary-parallel loss, or plain logits.

    chunked = attach_loss_head(meta_model, cfg.train, dims)     # before the pipeline split
    ... split, parallelize ...
    head = scoring_head(stages, pipeline) if chunked else None   # after tensor parallelism
    loss = ModelLoss(logits_loss_for(tp_ctx, vocab_size), head)
    value = loss(model, args, targets)                           # a micro-batch's mean loss

- The chunked head (chunked_loss.py) replaces the output Linear, with the same parameters:
  the model then returns the mean loss itself and the (tokens, vocabulary) logits never
  exist whole. Under tensor parallelism (1d) the plan turns it into the vocabulary-parallel
  head, which scores the same way on its vocabulary rows; on a pipeline's last stage it
  hands the schedule its input and `ModelLoss.logits_loss` scores that.
- Without it (train.chunked_loss false, the 2d/2.5d/3d grids): logits, scored by the tp
  context's vocabulary-parallel cross-entropy under tp, plain cross-entropy otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.config import TrainConfig
from polytrain.distributed.topology import ParallelDims
from polytrain.train.chunked_loss import LossHead, ScoringHead

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


def scoring_head(stages: dict[str, nn.Module], pipeline) -> ScoringHead | None:
    """The parallelized head of the stage holding it (None on a pipeline rank without the last
    stage); on a pipeline it is deferred: the schedule's loss calls it on the stage's output."""
    last = str(pipeline.num_stages - 1) if pipeline else ""
    if last not in stages:
        return None
    head = stages[last].output  # a LossHead, or tp's VocabParallelHead made from it
    head.deferred = pipeline is not None
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
