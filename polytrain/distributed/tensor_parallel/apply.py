"""Apply a model's tensor-parallel plan and its dropout streams, from outside the model.

    ctx = parallelize_model(model, ARCHITECTURES[arch].tp_plan(cfg.model), runtime)

With dropout and more than one rank, every layout gets per-rank dropout streams
(independent across data-parallel ranks and pipeline stages, shared or not across tp
ranks as the activations are; see polytrain/distributed/rng.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from polytrain.distributed.rng import DropoutRNG
from polytrain.distributed.tensor_parallel.plan import Context, parallelize_tp
from polytrain.lora import LoRALinear
from polytrain.models.common.plan import Plan

if TYPE_CHECKING:
    from polytrain.distributed.runtime import Runtime


def parallelize_model(model: nn.Module, plan: Plan | None, runtime: Runtime) -> Context | None:
    """Tensor/sequence parallelism over the tp mesh (axis or grid) and dropout streams, in place;
    on the meta device, before data parallelism.

    `plan` may be None when tp = 1. Returns the layers' shared context, or None when tp = 1.
    """
    dims, mesh = runtime.dims, runtime.mesh
    dropout = None
    if _draws_dropout(model) and mesh is not None:
        dropout = DropoutRNG(runtime.acc, runtime.coordinates)
    if dims.tp == 1:
        if dropout is not None:
            _fork_residual_stream(model, dropout)
        return None
    return parallelize_tp(model, plan, dims.tp_mesh(mesh), dims.sp, dims.tp_mode, dropout, dims.tp_overlap)


def _draws_dropout(model: nn.Module) -> bool:
    """The model's own dropout, or its LoRA adapters' (model.dropout = 0 with lora.dropout > 0)."""
    return model.cfg.dropout > 0 or any(isinstance(m, LoRALinear) and m.dropout > 0 for m in model.modules())


def _fork_residual_stream(model: nn.Module, dropout: DropoutRNG) -> None:
    """Without tp, every activation is this rank's own: one per-rank stream for the whole forward."""
    inner = model.forward

    def forward(*args, **kwargs):
        if not model.training:
            return inner(*args, **kwargs)
        with dropout.fork(sharded=True):
            return inner(*args, **kwargs)

    model.forward = forward
