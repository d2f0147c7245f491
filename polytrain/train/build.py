"""The model builder: a parallelized, materialized model for a runtime, from any caller.

    runtime, layout = start(cfg)
    built = build_model(runtime, cfg, layout.pipeline)
    optimizer = built.dp.build_optimizer(built.model, cfg.train)
    loss = built.loss(built.model, args, targets)            # or built.pipeline.train_step(...)

The order, on the meta device until the last step (so no rank ever holds the whole model
unless its layout keeps it whole):

    build (registry) -> pipeline split -> chunked loss head -> tensor/sequence parallel ->
    activation checkpointing -> data parallel / ZeRO -> real weights (seeded by name)
    [-> tied copies, autocast and the runner, for pipelines]

The trainer, `polytrain.initialize` and later engines (RLHF's four models) all build
through here; two models with different layouts (`runtime.with_dims(...)`) may be built
in one process on the same world.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from polytrain.config import Config
from polytrain.distributed.activation_checkpoint import apply_activation_checkpointing
from polytrain.distributed.data_parallel import DataParallel, build_data_parallel
from polytrain.distributed.materialize import materialize
from polytrain.distributed.pipeline import PipelinePlan, PipelineRunner, split_model
from polytrain.distributed.pipeline.build import StageShapes, build_pipeline
from polytrain.distributed.runtime import Runtime
from polytrain.distributed.tensor_parallel import Context, parallelize_model
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.train.loss import ModelLoss, attach_loss_head, logits_loss_for

AUTOCAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class BuiltModel:
    """A model ready to train on this rank, with what drives it."""

    model: nn.Module
    """The model, or under pipeline parallelism an nn.ModuleDict of this rank's stages
    ({global stage index: pruned model}) that `pipeline` runs."""
    dp: DataParallel
    """Its data-parallel strategy: build_optimizer, gradient sync, clipping, step, state dict."""
    loss: ModelLoss | None
    """A micro-batch's mean loss (None for a user's model, whose forward computes its own, and
    for a value model, whose loss is its caller's: rlhf's reward and value losses)."""
    pipeline: PipelineRunner | None
    tp_ctx: Context | None
    """What its tensor-parallel layers share (None without tp)."""
    num_params: int
    """Parameters of the whole model, whatever part of it this rank holds."""
    flops_per_token: float


def build_model(runtime: Runtime, cfg: Config, pipeline: PipelinePlan | None = None,
                run_dir: Path | None = None) -> BuiltModel:
    """`cfg.model` from the registry, laid out by `runtime` (and `pipeline`, the layout's plan).

    `cfg.train` picks activation checkpointing, the chunked loss and the pipeline's autocast;
    `cfg.parallel` the data-parallel strategy; `run_dir` holds nvme offload files by default.
    """
    arch = ARCHITECTURES[cfg.model.arch]
    with torch.device("meta"):
        model = arch.build(cfg.model)
    num_params, flops = model.num_params(), model.flops_per_token(cfg.data.seq_len)
    stages = split_model(model, pipeline, runtime.axis_rank("pp")) if pipeline else {"": model}
    lm = cfg.model.head == "lm"  # a value model (reward model, critic) returns values: no LM loss head
    head = attach_loss_head(model, cfg.train, runtime.dims, pipelined=pipeline is not None) if lm else None
    plan = arch.tp_plan(cfg.model) if runtime.dims.tp > 1 else None
    tp_ctx = None
    for stage in stages.values():
        tp_ctx = parallelize_model(stage, plan, runtime)  # the same context kind on every stage
        apply_activation_checkpointing(stage, cfg.train.activation_checkpoint)
    dp = build_data_parallel(runtime, cfg.parallel, run_dir)
    model = dp.parallelize(stages if pipeline else model)
    runner = None
    if pipeline:
        shapes = StageShapes(cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.dim, cfg.model.vocab_size)
        dtype = AUTOCAST[cfg.train.precision]
        runner = build_pipeline(model, pipeline, runtime, dp, shapes, seed=cfg.run.seed,
                                tied=cfg.model.tie_embeddings, autocast=lambda: runtime.acc.autocast(dtype))
    else:
        materialize(model, runtime.device, cfg.run.seed)
    loss = ModelLoss(logits_loss_for(tp_ctx, cfg.model.vocab_size), head) if lm else None
    return BuiltModel(model, dp, loss, runner, tp_ctx, num_params, flops)


def place_model(runtime: Runtime, module: nn.Module, cfg: Config, seed: int) -> BuiltModel:
    """A user's model (`polytrain.initialize`'s), on this rank's device, laid out by `cfg.parallel`.

    A model built on the meta device is materialised after sharding, as registry models are,
    so it must provide `init_parameter`/`init_buffers` (polytrain's models do). A built
    model is broadcast from rank 0, so ranks that initialised it differently agree.
    """
    on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    if on_meta and not (hasattr(module, "init_parameter") and hasattr(module, "init_buffers")):
        raise ConfigError(f"{type(module).__name__} has parameters on the meta device but no "
                          "init_parameter/init_buffers to create them; build it on the CPU")
    if not on_meta:
        module.to(runtime.device)
        _broadcast_from_rank0(module)
    dp = build_data_parallel(runtime, cfg.parallel)
    module = dp.parallelize(module)
    if on_meta:
        materialize(module, runtime.device, seed)
    num_params = sum(p.numel() for p in module.parameters())
    return BuiltModel(module, dp, None, None, None, num_params, 0.0)


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    # A user's model has no model-parallel axes, so the world is its data-parallel group.
    if dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.detach(), src=0)
