"""Tensor parallelism: layers split over the tp mesh axis, applied to a model from outside by a plan.

    ctx = parallelize_tp(model, plan, dims.tp_mesh(mesh), sp, mode)   # plan: module patterns -> roles
    loss_fn = ctx.loss_fn(vocab_size)                                  # on the split logits

plan.py (roles and their application, the modes), one_d.py (Megatron's 1D layers),
context.py (what 1D layers share), cross_entropy.py, checks.py (start-up validation);
the grid modes: grid.py (axes, groups, what grid layers share), summa.py (2D, 2.5D),
three_d.py (3D), grid_layers.py (their norms, embedding lookup, root).
"""

from polytrain.distributed.tensor_parallel.context import TPContext, shard_range, shard_sizes
from polytrain.distributed.tensor_parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_loss,
    vocab_parallel_token_logprobs,
)
from polytrain.distributed.tensor_parallel.plan import (
    Column,
    ColumnTable,
    Context,
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
    "Column", "ColumnTable", "Context", "Norm", "Plan", "Region", "ResidualTable", "Root", "Row",
    "TPContext", "VocabEmbedding", "VocabHead",
    "parallelize_tp", "shard_range", "shard_sizes", "vocab_parallel_cross_entropy", "vocab_parallel_loss",
    "vocab_parallel_token_logprobs",
]
