"""Tensor parallelism: layers split over the tp mesh axis, applied to a model from outside by a plan.

    ctx = parallelize_tp(model, plan, dims_mesh["tp"], sp=True)   # plan: module patterns -> roles
    loss_fn = vocab_parallel_loss(mesh["tp"], vocab_size)          # on the vocabulary-split logits

plan.py (roles and their application), one_d.py (Megatron's 1D layers), context.py
(what the layers share), cross_entropy.py, checks.py (start-up validation).
"""

from polytrain.distributed.tensor_parallel.context import TPContext, shard_range, shard_sizes
from polytrain.distributed.tensor_parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_loss,
)
from polytrain.distributed.tensor_parallel.plan import (
    Column,
    ColumnTable,
    Norm,
    Plan,
    Region,
    ResidualTable,
    Root,
    Row,
    VocabEmbedding,
    VocabHead,
    parallelize_tp,
)

__all__ = [
    "Column", "ColumnTable", "Norm", "Plan", "Region", "ResidualTable", "Root", "Row", "TPContext",
    "VocabEmbedding", "VocabHead",
    "parallelize_tp", "shard_range", "shard_sizes", "vocab_parallel_cross_entropy", "vocab_parallel_loss",
]
