"""Apply a model's tensor-parallel plan and its dropout streams: what every architecture's parallelize does.

    ctx = parallelize_model(model, tp_plan(model.cfg), dims, mesh)   # in models/<arch>/parallelize.py
    parallelize = parallelizer(tp_plan)                              # or, when that is all it does

plus the roles of the shared layers (polytrain/models/common), which every plan splits
alike: attention by heads, the feed-forward block by hidden features.

With dropout and more than one rank, every layout gets per-rank dropout streams
(independent across data-parallel ranks and pipeline stages, shared or not across tp
ranks as the activations are; see polytrain/distributed/rng.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain.backend import get_accelerator
from polytrain.distributed.rng import DropoutRNG
from polytrain.distributed.tensor_parallel.plan import Column, Context, Plan, Region, Row, parallelize_tp

if TYPE_CHECKING:
    from polytrain.config import ModelConfig
    from polytrain.distributed.topology import ParallelDims


def parallelize_model(model: nn.Module, plan: Plan, dims: ParallelDims,
                      mesh: DeviceMesh | None) -> Context | None:
    """Tensor/sequence parallelism over the tp mesh (axis or grid) and dropout streams, in place;
    before data parallelism.

    Returns the layers' shared context, or None when tp = 1.
    """
    dropout = None
    if model.cfg.dropout > 0 and mesh is not None:
        dropout = DropoutRNG(get_accelerator(), dims.coordinates(dist.get_rank()))
    if dims.tp == 1:
        if dropout is not None:
            _fork_residual_stream(model, dropout)
        return None
    return parallelize_tp(model, plan, dims.tp_mesh(mesh), dims.sp, dims.tp_mode, dropout)


def parallelizer(tp_plan: Callable[[ModelConfig], Plan]) -> Callable:
    """`parallelize(model, dims, mesh)` (Architecture.parallelize_module's) applying `tp_plan(model.cfg)`."""
    def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None) -> Context | None:
        """Tensor/sequence parallelism and dropout streams, in place; None when tp = 1."""
        return parallelize_model(model, tp_plan(model.cfg), dims, mesh)

    return parallelize


def _fork_residual_stream(model: nn.Module, dropout: DropoutRNG) -> None:
    """Without tp, every activation is this rank's own: one per-rank stream for the whole forward."""
    inner = model.forward

    def forward(*args, **kwargs):
        if not model.training:
            return inner(*args, **kwargs)
        with dropout.fork(sharded=True):
            return inner(*args, **kwargs)

    model.forward = forward


def attention_roles(path: str, head_dim: int, shared_kv: bool = False, inputs: int = 1) -> Plan:
    """Roles of a common Attention at module pattern `path`, split by heads.

    wq/wk/wv are columns of whole heads (`head_dim` rows each), wo a row; the core
    (softmax(q k^T) v on this rank's heads) draws per-rank dropout. `shared_kv`: tp may
    exceed the KV heads, each then replicated on tp / n_kv_heads ranks. `inputs`: 2 for
    cross-attention, whose memory (the encoder's output) enters the region too.
    """
    return {path: Region(sharded_methods=("core",), inputs=inputs),
            f"{path}.wq": Column(unit=head_dim),
            f"{path}.wk": Column(unit=head_dim, shared_units=shared_kv),
            f"{path}.wv": Column(unit=head_dim, shared_units=shared_kv),
            f"{path}.wo": Row()}


def feed_forward_roles(path: str) -> Plan:
    """Roles of a common FeedForward at `path`: w1 (and w3 when gated) columns, w2 a row."""
    return {path: Region(), f"{path}.w1": Column(), f"{path}.w3": Column(), f"{path}.w2": Row()}
