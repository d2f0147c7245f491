"""Context parallelism: one sequence split over ranks, attention computed across them.

- `layout.py`: which slots each rank holds (zigzag over the ring, slices over Ulysses),
  sharding and unsharding, the cp process groups;
- `ulysses.py`: the all-to-alls between sequence and head shards;
- `ring.py`: ring attention with overlapped K/V passing and LSE merging;
- `attention.py`: `ContextParallel`, the Attention.core replacement for every mode;
- `apply.py`: applying it to a model or pipeline stage (cores, positions and document ids
  injected into the forward), the per-batch set-up, datasets that yield shards;
- `decode.py`: the KV cache split over the group and decoding attention over it;
- `cost.py`: the bytes each mode sends per layer (the analytic formulas);
- `checks.py`: start-up checks of the degrees against the sequence, heads and other axes.

The attention kernel itself (blockwise, online softmax) is models/common/blockwise_attention.py.
"""

from polytrain.distributed.context_parallel.attention import ContextParallel
from polytrain.distributed.context_parallel.layout import CPGroups, Layout, new_cp_groups

__all__ = ["CPGroups", "ContextParallel", "Layout", "new_cp_groups"]
