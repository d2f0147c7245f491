"""How a T5 is split for tensor and sequence parallelism.

Data only: polytrain.distributed applies it. Self- and cross-attention are split by
heads (wq/wk/wv columns, wo a row) and so are the relative-position bias tables
(buckets, heads): each rank looks up the biases of its own heads. Cross-attention's
memory (the encoder's output, replicated, or this rank's tokens under SP) enters the
tensor-parallel region with its queries' states, so its gradient is summed over tp.
The feed-forward block (ReLU or gated GELU) splits by hidden features; the token
table, shared by encoder and decoder, and the output head (tied or not) by
vocabulary; the RMS norms stay replicated. The v1.0 output scaling is elementwise on
replicated states and needs nothing.

Under SP both streams are split along their sequence: the encoder input and the
decoder input lengths must be multiples of tp (checked at start-up).
"""

from __future__ import annotations

from polytrain.config import ModelConfig
from polytrain.models.common.base import head_dim
from polytrain.models.common.plan import (
    ColumnTable,
    Norm,
    Plan,
    Root,
    VocabEmbedding,
    VocabHead,
    attention_roles,
    feed_forward_roles,
)


def tp_plan(cfg: ModelConfig) -> Plan:
    """Module-name patterns of a T5 -> their tensor-parallel roles."""
    return {
        "": Root(),
        "tok_embeddings": VocabEmbedding(),
        "encoder_pos_bias": ColumnTable(),  # (buckets, heads): heads split like the attention's
        "decoder_pos_bias": ColumnTable(),
        "layers.*.attention_norm": Norm(),
        **attention_roles("layers.*.attention", head_dim(cfg)),
        "layers.*.cross_attention_norm": Norm(),
        **attention_roles("layers.*.cross_attention", head_dim(cfg), inputs=2),  # (x, memory)
        "layers.*.ffn_norm": Norm(),
        **feed_forward_roles("layers.*.feed_forward"),
        "encoder_norm": Norm(),
        "decoder_norm": Norm(),
        "output": VocabHead(),
    }

