"""Stage modules: pruned copies of the meta model that keep the global module names.

A stage holding layers 2-3 of a 4-layer Llama is the same `Llama` class with
tok_embeddings, norm and output set to None and layers "0", "1" deleted; its
parameters are still named `layers.2.attention.wq.weight`, so initialisation (seeded
by name), checkpoints (keyed by name) and later tensor-parallel plans (matched by
name) see the same names at every pipeline layout.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from polytrain.distributed.pipeline.plan import PipelinePlan


def split_model(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> nn.ModuleDict:
    """This rank's stages of `model` (on the meta device), keyed by global stage index ("0", "3", ...).

    The ModuleDict only groups them; each value is run on its own by the schedule.
    """
    stages = nn.ModuleDict()
    units = [unit for stage in plan.stages for unit in stage]
    for index in plan.stages_of_rank(pp_rank):
        stages[str(index)] = prune(model, plan.stages[index], units)
    return stages


def prune(model: nn.Module, keep: tuple[str, ...], units: list[str]) -> nn.Module:
    """A copy of `model` that holds only the units in `keep` of all its `units` (top-level
    modules, set to None when dropped, or `layers.<i>`, deleted)."""
    # Deep-copying a meta model copies no data; it is only module objects.
    stage = copy.deepcopy(model)
    wanted = set(keep)
    for name in [f"layers.{i}" for i in stage.layers]:
        if name not in wanted:
            del stage.layers[name.split(".", 1)[1]]
    for name in units:
        if not name.startswith("layers.") and name not in wanted:
            setattr(stage, name, None)
    return stage


def run_under(module: nn.Module, context: Callable[[], ContextManager]) -> None:
    """Make `module`'s forward run inside `context()` (e.g. autocast), leaving its backward outside.

    The schedule calls the stage module itself, so the mixed-precision context of the
    single-process loop has to travel with the module; replacing the bound method on
    the instance keeps every module name.
    """
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with context():
            return inner(*args, **kwargs)

    module.forward = forward


def pipeline_stages(modules: dict[int, nn.Module], plan: PipelinePlan, group, device: torch.device,
                    micro_batch_size: int, seq_len: int, hidden_shape: tuple[int, ...],
                    logits_shape: tuple[int, ...],
                    activation_dtype: torch.dtype = torch.float32) -> list[PipelineStage]:
    """torch PipelineStages for this rank's `modules` {global stage index: module}, with static shapes.

    Giving every stage its input and output shapes up front (per micro-batch: tokens
    (mbs, T) int64 into the first stage, the residual stream `hidden_shape` in fp32
    between stages, `logits_shape` out of the last) skips torch's shape inference,
    which would run the stage once on fake data: parallel layers whose collectives
    cannot run there (tensor parallelism) would break it. `activation_dtype` is the
    residual stream's and the logits': fp32 under bf16/fp16 autocast with fp32 weights
    (blocks add their low-precision outputs to an fp32 stream, and RMSNorm returns its
    input's dtype), 16-bit with 16-bit weights, whose embedding starts a 16-bit stream.
    """
    def meta(shape, dtype):
        # requires_grad marks what carries a gradient back: torch derives the
        # gradient buffers' shapes from these and allocates none for the rest.
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    stages = []
    for index, module in sorted(modules.items()):
        first, last = index == 0, index == plan.num_stages - 1
        inputs = meta((micro_batch_size, seq_len), torch.long) if first else meta(hidden_shape, activation_dtype)
        outputs = meta(logits_shape, activation_dtype) if last else meta(hidden_shape, activation_dtype)
        stages.append(PipelineStage(module, index, plan.num_stages, device, input_args=inputs,
                                    output_args=outputs, group=group))
    return stages
