"""How a GPT-2 (or a pipeline stage of one) is split for tensor and sequence parallelism.

Data only: polytrain.distributed applies it. As Llama's plan, with biases: q/k/v
and the MLP's up projection are columns whose biases split with their output features;
wo and the down projection are rows whose (replicated) bias is added once, after the
partial sums are reduced. LayerNorms (gain and bias) stay replicated and run on this
rank's tokens under SP. The learned position table is replicated; under SP each rank
adds the rows of its own sequence slice. The output head is the vocabulary-split token
table (tied).
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
    """Module-name patterns of a GPT-2 -> their tensor-parallel roles."""
    return {
        "": Root(),
        "tok_embeddings": VocabEmbedding(),
        "pos_embeddings": ResidualTable(),
        "layers.*.attention_norm": Norm(),
        **attention_roles("layers.*.attention", head_dim(cfg)),
        "layers.*.ffn_norm": Norm(),
        **feed_forward_roles("layers.*.feed_forward"),
        "norm": Norm(),
        "output": VocabHead(),
    }

