"""Finish this rank's pipeline stages: tied copies, real weights, autocast, and the runner.

    stages = split_model(meta_model, plan, runtime.axis_rank("pp"))
    ... tensor parallel, activation checkpointing, dp.parallelize(stages) ...
    runner = build_pipeline(stages, plan, runtime, dp, shapes, weights=..., tied=..., autocast=...)

What the stage modules need between data parallelism and the first step, in order:
the two-copy tied embedding (tied.py) must exist before materialization (the copy takes
the embedding's initial values), and the strategy must know the copy's name (norm and
checkpoint keys); the schedule calls the stage modules itself, so the mixed-precision
context travels with them; and torch's PipelineStages get static shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn as nn

from polytrain.distributed.pipeline.plan import PipelinePlan
from polytrain.distributed.pipeline.runner import PipelineRunner
from polytrain.distributed.pipeline.stages import run_under
from polytrain.distributed.pipeline.tied import COPIES, TiedEmbeddings
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.tensor_parallel.shards import shard_sizes


@dataclass(frozen=True)
class StageShapes:
    """Per micro-batch: tokens (micro_batch_size, seq_len) in, logits (.., vocab_size) out."""

    micro_batch_size: int
    seq_len: int
    dim: int
    vocab_size: int
    activation_dtype: torch.dtype = torch.float32
    """Of the residual stream between stages and the logits: 16-bit with 16-bit weights."""


def build_pipeline(stages: nn.ModuleDict, plan: PipelinePlan, runtime: Runtime, dp, shapes: StageShapes, *,
                   weights: Callable, tied: bool, autocast: Callable[[], ContextManager],
                   head_scores: bool = False) -> PipelineRunner:
    """Materialize this rank's parallelized `stages` (on meta) and return the runner over them.

    `dp`: the PipelineDataParallel that parallelized them; `weights(stage, device, init_as)`
    materializes one stage (materialize.py's, with the strategy's precision and placement);
    `tied`: the model ties its embedding and output head (the last stage then holds a copy);
    `head_scores`: the last stage's head is a deferred chunked-loss head, so the stage
    outputs hidden states.
    """
    copies = TiedEmbeddings(stages, plan, runtime.mesh, dp.accumulated_grad) if tied else None
    for stage in stages.values():
        weights(stage, runtime.device, init_as=COPIES if copies else None)
        run_under(stage, autocast)  # the schedule calls the stages; autocast goes with them
    if copies:
        dp.copies = COPIES
    dims = runtime.dims
    # Under tp the head's logits are this rank's vocabulary slice; under sp the residual
    # stream between stages is this rank's sequence slice.
    vocab = shard_sizes(shapes.vocab_size, dims.tp)[runtime.axis_rank("tp")]
    mbs, seq = shapes.micro_batch_size, shapes.seq_len
    hidden = (mbs, seq // dims.tp if dims.sp else seq, shapes.dim)
    out = hidden if head_scores else (mbs, seq, vocab)
    return PipelineRunner(plan, stages, runtime.axis_rank("pp"), runtime.mesh["pp"].get_group(), runtime.device,
                          mbs, seq, hidden_shape=hidden, logits_shape=out,
                          after_backward=copies.sum_gradients if copies else None,
                          activation_dtype=shapes.activation_dtype)
