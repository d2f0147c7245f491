"""How a Llama (or a pipeline stage of one) is split for tensor and sequence parallelism.

The only llama file that knows about parallelism. Attention is split by heads (wq/wk/wv
columns, wo a row), the SwiGLU MLP by hidden features (w1/w3 columns, w2 a row), the
embedding and output head by vocabulary; norms stay replicated and, under sequence
parallelism, run on this rank's tokens. A tied output head shares the embedding's
vocabulary-split weight.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain.backend import get_accelerator
from polytrain.config import ModelConfig
from polytrain.distributed.rng import DropoutRNG
from polytrain.distributed.tensor_parallel import (
    Column,
    Norm,
    Plan,
    Region,
    Root,
    Row,
    TPContext,
    VocabEmbedding,
    VocabHead,
    parallelize_tp,
)
from polytrain.distributed.topology import ParallelDims


def tp_plan(cfg: ModelConfig) -> Plan:
    """Module-name patterns of a Llama -> their tensor-parallel roles."""
    head_dim = cfg.dim // cfg.n_heads
    return {
        "": Root(),
        "tok_embeddings": VocabEmbedding(),
        "layers.*.attention_norm": Norm(),
        "layers.*.attention": Region(sharded_methods=("core",)),  # core: softmax(q k^T) v on local heads
        "layers.*.attention.wq": Column(unit=head_dim),
        "layers.*.attention.wk": Column(unit=head_dim, shared_units=True),  # tp > n_kv_heads shares KV heads
        "layers.*.attention.wv": Column(unit=head_dim, shared_units=True),
        "layers.*.attention.wo": Row(),
        "layers.*.ffn_norm": Norm(),
        "layers.*.feed_forward": Region(),
        "layers.*.feed_forward.w1": Column(),
        "layers.*.feed_forward.w3": Column(),
        "layers.*.feed_forward.w2": Row(),
        "norm": Norm(),
        "output": VocabHead(),
    }


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None) -> TPContext | None:
    """Tensor/sequence parallelism over mesh["tp"] and dropout streams, in place; before data parallelism.

    Returns the layers' shared context, or None when tp = 1. With dropout and more than
    one rank, every layout gets per-rank dropout streams (independent across data-parallel
    ranks, shared or not across tp ranks as the activations are).
    """
    cfg: ModelConfig = model.cfg
    dropout = None
    if cfg.dropout > 0 and mesh is not None:
        dropout = DropoutRNG(get_accelerator(), dims.coordinates(dist.get_rank()))
    if dims.tp == 1:
        if dropout is not None:
            _fork_residual_stream(model, dropout)
        return None
    ctx = parallelize_tp(model, tp_plan(cfg), mesh["tp"], dims.sp, dropout=dropout)
    if dims.sp and model.tok_embeddings is None:
        _rope_for_whole_sequence(model, ctx)
    return ctx


def _fork_residual_stream(model: nn.Module, dropout: DropoutRNG) -> None:
    """Without tp, every activation is this rank's own: one per-rank stream for the whole forward."""
    inner = model.forward

    def forward(*args, **kwargs):
        if not model.training:
            return inner(*args, **kwargs)
        with dropout.fork(sharded=True):
            return inner(*args, **kwargs)

    model.forward = forward


def _rope_for_whole_sequence(model: nn.Module, ctx: TPContext) -> None:
    """A later pipeline stage under SP receives (B, T/tp, D): RoPE and masks must cover all T.

    Attention runs on the gathered sequence, so its position tables are those of the
    full length, T/tp x tp.
    """
    inner = model._attention_inputs

    def attention_inputs(seqlen, cache, start_pos, device):
        return inner(seqlen * ctx.size if ctx.sp_active else seqlen, cache, start_pos, device)

    model._attention_inputs = attention_inputs
