"""How a Llama (or a pipeline stage of one) is split for tensor and sequence parallelism.

The only llama file that knows about parallelism. Attention is split by heads (wq/wk/wv
columns, wo a row), the SwiGLU MLP by hidden features (w1/w3 columns, w2 a row), the
embedding and output head by vocabulary; norms stay replicated and, under sequence
parallelism, run on this rank's tokens. A tied output head shares the embedding's
vocabulary-split weight. The same plan drives every parallel.tp_mode: under 2d / 2.5d /
3d the grid splits heads and hidden features the same way (by head blocks), and also
the sequences of the micro-batch.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain.config import ModelConfig
from polytrain.distributed.tensor_parallel import (
    Context,
    Norm,
    Plan,
    Root,
    TPContext,
    VocabEmbedding,
    VocabHead,
)
from polytrain.distributed.tensor_parallel.apply import (
    attention_roles,
    feed_forward_roles,
    parallelize_model,
)
from polytrain.distributed.topology import ParallelDims
from polytrain.models.common.base import head_dim


def tp_plan(cfg: ModelConfig) -> Plan:
    """Module-name patterns of a Llama -> their tensor-parallel roles."""
    return {
        "": Root(),
        "tok_embeddings": VocabEmbedding(),
        "layers.*.attention_norm": Norm(),
        # tp > n_kv_heads replicates each KV head on tp / n_kv_heads ranks
        **attention_roles("layers.*.attention", head_dim(cfg), shared_kv=True),
        "layers.*.ffn_norm": Norm(),
        **feed_forward_roles("layers.*.feed_forward"),
        "norm": Norm(),
        "output": VocabHead(),
    }


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None,
                plan: Plan | None = None) -> Context | None:
    """Tensor/sequence parallelism over the tp mesh (axis or grid) and dropout streams, in place;
    before data parallelism.

    Returns the layers' shared context, or None when tp = 1. `plan`: a subclass's (InternLM2's).
    """
    ctx = parallelize_model(model, plan or tp_plan(model.cfg), dims, mesh)
    if ctx is not None and dims.sp and model.tok_embeddings is None:
        _rope_for_whole_sequence(model, ctx)
    return ctx


def _rope_for_whole_sequence(model: nn.Module, ctx: TPContext) -> None:
    """A later pipeline stage under SP receives (B, T/tp, D): RoPE and masks must cover all T.

    Attention runs on the gathered sequence, so its position tables are those of the
    full length, T/tp x tp.
    """
    inner = model._attention_inputs

    def attention_inputs(seqlen, *args):
        return inner(seqlen * ctx.size if ctx.sp_active else seqlen, *args)

    model._attention_inputs = attention_inputs
