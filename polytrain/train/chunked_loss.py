"""The chunked loss on one rank: a model's output Linear that returns the loss.

The trainer swaps the model's `output` Linear for a `LossHead` (same parameters, same
state-dict keys) and asks it for the loss:

    with head.scoring(targets):     # targets (B, T), -100 = not scored
        loss = model(tokens)        # the head returns the mean loss, not (B, T, V) logits

Outside `scoring` the head is an ordinary Linear (evaluation of logits, generation). The
algorithm (and its vocabulary-parallel form, which tensor parallelism's head uses) is in
polytrain/distributed/linear_cross_entropy.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from polytrain.distributed.linear_cross_entropy import (  # noqa: F401 (re-exported)
    IGNORE_INDEX,
    MIN_CHUNK_TOKENS,
    ScoringHead,
    chunk_tokens,
    linear_cross_entropy,
)


class LossHead(ScoringHead, nn.Linear):
    """A model's output projection that returns the loss while `scoring(targets)` is active."""

    @classmethod
    def replacing(cls, linear: nn.Linear) -> "LossHead":
        """A LossHead holding `linear`'s own parameters (tied ones stay tied)."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.in_features, head.out_features = linear.in_features, linear.out_features
        head.weight, head.bias = linear.weight, linear.bias
        return head

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of hidden (B, T, D) against targets (B, T)."""
        return linear_cross_entropy(hidden, self.weight, self.bias, targets,
                                    compile_backend=self.compile_backend, matmul_dtype=self.matmul_dtype,
                                    product=self.chunk_product)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scored = self.scored_forward(hidden)
        return super().forward(hidden) if scored is None else scored
