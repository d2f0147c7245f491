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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.config import TrainConfig
from polytrain.distributed.topology import ParallelDims
from polytrain.train.chunked_loss import LossHead

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
