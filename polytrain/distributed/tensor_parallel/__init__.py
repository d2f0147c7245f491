"""Tensor parallelism: layers split over the tp mesh axis, applied to a model from outside by a plan.

    ctx = parallelize_model(model, plan, runtime)   # plan: module patterns -> roles (models/<arch>/plan.py)
    loss_fn = ctx.loss_fn(vocab_size)               # on the split logits

apply.py (a model's plan and its dropout streams), plan.py (each role's implementation in
each mode), one_d.py (Megatron's 1D layers), context.py (what 1D layers share),
shards.py (how a dimension splits), cross_entropy.py, checks.py (start-up validation);
the grid modes: grid.py (axes, groups, what grid layers share), summa.py (2D, 2.5D),
three_d.py (3D), grid_layers.py (their norms, embedding lookup, root).
"""

from polytrain.distributed.tensor_parallel.apply import parallelize_model
from polytrain.distributed.tensor_parallel.context import TPContext
from polytrain.distributed.tensor_parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_loss,
)
from polytrain.distributed.tensor_parallel.plan import Context, parallelize_tp
from polytrain.distributed.tensor_parallel.shards import shard_range, shard_sizes

__all__ = [
    "Context", "TPContext", "parallelize_model", "parallelize_tp", "shard_range", "shard_sizes",
    "vocab_parallel_cross_entropy", "vocab_parallel_loss",
]
