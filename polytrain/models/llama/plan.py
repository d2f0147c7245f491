"""How a Llama (or a pipeline stage of one) is split for tensor and sequence parallelism.

Data only: polytrain.distributed applies it. Attention is split by heads (wq/wk/wv
columns, wo a row), the SwiGLU MLP by hidden features (w1/w3 columns, w2 a row), the
embedding and output head by vocabulary; norms stay replicated and, under sequence
parallelism, run on this rank's tokens. A tied output head shares the embedding's
vocabulary-split weight. The same plan drives every parallel.tp_mode: under 2d / 2.5d /
3d the grid splits heads and hidden features the same way (by head blocks), and also
the sequences of the micro-batch.
"""

from __future__ import annotations

from polytrain.config import ModelConfig
from polytrain.models.common.base import head_dim
from polytrain.models.common.plan import (
    Norm,
    Plan,
    Root,
    VocabEmbedding,
    VocabHead,
    attention_roles,
    feed_forward_roles,
)


def tp_plan(cfg: ModelConfig) -> Plan:
    """Module-name patterns of a Llama -> their tensor-parallel roles."""
    return {
        # RoPE tables and masks come from `attention_inputs(seqlen, ...)`, which a later
        # pipeline stage under SP must ask for the whole sequence.
        "": Root(attention_inputs="attention_inputs"),
        "tok_embeddings": VocabEmbedding(),
        "layers.*.attention_norm": Norm(),
        # tp > n_kv_heads replicates each KV head on tp / n_kv_heads ranks
        **attention_roles("layers.*.attention", head_dim(cfg), shared_kv=True),
        "layers.*.ffn_norm": Norm(),
        **feed_forward_roles("layers.*.feed_forward"),
        "norm": Norm(),
        "output": VocabHead(),
    }
