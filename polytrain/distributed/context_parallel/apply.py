"""Context parallelism applied to a model (or pipeline stage) from outside, and its batches.

    cp = ContextParallel(runtime.cp)
    parallelize_context(stage, cp)          # before tensor parallelism and checkpointing wrap it
    cp.begin(tokens, eot_id)                # per micro-batch (or pipeline run), whole sequences
    loss = model(cp.shard(tokens))          # positions (and document ids) come from cp.begin

`parallelize_context` replaces every block's attention core and wraps the forward: a call
without `positions` gets this rank's global positions of the current batch (with packed
documents, the positions inside each document and the document ids), so every pipeline
stage sees them though the schedule passes only hidden states. Generation (a KV cache
argument) is left alone: generate_cp passes its own positions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from polytrain.data.documents import document_ids, document_positions
from polytrain.distributed.context_parallel.attention import ContextParallel


@dataclass(frozen=True)
class CPBatch:
    """What the forward wrapper adds to this rank's shard of a batch."""

    positions: torch.Tensor
    """(T/P,) global slots, or (B, T/P) positions inside each packed document."""
    documents: torch.Tensor | None
    """(B, T/P) this rank's document ids (the whole batch's are ContextParallel.documents)."""


def begin_batch(cp: ContextParallel, tokens: torch.Tensor, eot_id: int | None = None) -> None:
    """Set up a batch of whole sequences (B, T): positions, and with `eot_id` packed-document ids."""
    T = tokens.shape[1]
    slots = cp.layout(T).slots(cp.groups.cp_rank).to(tokens.device)
    if eot_id is None:
        cp.documents, cp.batch = None, CPBatch(slots, None)
        return
    ids = document_ids(tokens, eot_id)  # (B, T)
    cp.documents = ids
    cp.batch = CPBatch(document_positions(ids)[:, slots], ids[:, slots])


def parallelize_context(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Context-parallel attention cores and the forward's positions for `model`, in place."""
    cp.apply(model)
    inner = model.forward
    signature = inspect.signature(inner)

    def forward(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        batch = cp.batch
        if batch is not None and not cp.decoding and given.get("cache") is None:
            if given.get("positions") is None:
                kwargs["positions"] = batch.positions
            if batch.documents is not None and given.get("documents") is None:
                kwargs["documents"] = batch.documents
        return inner(*args, **kwargs)

    model.forward = forward
    return model


class ShardedData:
    """A dataset whose batches come out as this rank's shard (for a pipeline runner that reads data itself)."""

    def __init__(self, data, cp: ContextParallel, eot_id: int | None = None):
        self.data, self.cp, self.eot_id = data, cp, eot_id

    def __len__(self) -> int:
        return len(self.data)

    def get_batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.data.get_batch(indices)  # (B, T) whole sequences
        begin_batch(self.cp, inputs, self.eot_id)
        return self.cp.shard(inputs), self.cp.shard(targets)
