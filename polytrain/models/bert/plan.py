"""How a BERT is split for tensor and sequence parallelism.

Data only: polytrain.distributed applies it. Attention by heads and the GELU
feed-forward by hidden features, their biases split with columns or added once after a
row's reduce; the post-norm LayerNorms stay replicated (under SP they run on this
rank's tokens). The token table is split by vocabulary; the position and token-type
tables are replicated residual tables (under SP each rank adds its own tokens' rows).

The MLM head's transform (head_dense, dim x dim, then GELU and head_norm) stays
replicated, in the Norm role (a replicated module on the residual stream, any class):
it is as small as one attention projection, and splitting it would cost two
collectives per step for a saving of dim^2 / tp parameters. Its decoder is the tied
vocabulary-split token table with its per-token bias split alongside, so the logits
stay split for the vocabulary-parallel loss.
"""

from __future__ import annotations

from polytrain.config import ModelConfig
from polytrain.models.common.base import head_dim
from polytrain.models.common.plan import (
    Norm,
    Plan,
    ResidualTable,
    Root,
    VocabEmbedding,
    VocabHead,
    attention_roles,
    feed_forward_roles,
)


def tp_plan(cfg: ModelConfig) -> Plan:
    """Module-name patterns of a BERT -> their tensor-parallel roles."""
    return {
        "": Root(),
        "tok_embeddings": VocabEmbedding(),
        "pos_embeddings": ResidualTable(),
        "type_embeddings": ResidualTable(),
        "embed_norm": Norm(),
        **attention_roles("layers.*.attention", head_dim(cfg)),
        "layers.*.attention_norm": Norm(),
        **feed_forward_roles("layers.*.feed_forward"),
        "layers.*.ffn_norm": Norm(),
        "head_dense": Norm(),
        "head_norm": Norm(),
        "output": VocabHead(),
    }

