"""Layer-wise adaptive optimizers (LAMB, LARS): each tensor's step is scaled by a trust ratio.

    ratio_i = ||w_i|| / ||x_i||-based denominator     (one scalar per parameter tensor i)

The norms are of the WHOLE tensor, wherever its pieces live. An optimizer computes, on
this rank, the sums of squares of its local pieces, one row per adapted tensor:

    local (n, 2) = [[sum(w_0^2), sum(x_0^2)], [sum(w_1^2), sum(x_1^2)], ...]

and a `SquareSums` function turns them into the whole tensors' sums. The default,
`whole_square_sums`, reads DTensor placements (FSDP2's ZeRO-3 Shard(0) over dp, tensor
parallel Shard over tp, both on a 2-D mesh); ZeRO-1/2, whose inner optimizer steps plain
row slices of flat buffers, passes its own (one all-reduce over the dp group).

Parameter groups carry `adapt`: False steps the group's tensors with ratio 1 (the plain
Adam / momentum-SGD update); `param_groups` in builder.py sets it False, with weight
decay 0, for biases and norm gains, as both papers do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# (tensors as the optimizer holds them, local partial sums (n, k)) -> whole-tensor sums (n, k)
SquareSums = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]


@torch.no_grad()
def whole_square_sums(tensors: list[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """Sum `local` (n, k) over the ranks holding the other pieces of each tensor; in place.

    A DTensor's row is all-reduced over each mesh dimension on which it is sharded (a
    Replicate dimension holds copies, which must count once, so it is skipped). "Sharded"
    is any placement but Replicate: FSDP2 over tensor-parallel Shard(0) weights places them
    as (_StridedShard(0), Shard(0)), and a _StridedShard is not `is_shard()`. Rows
    are batched per process group: one all-reduce per group for all tensors sharded over
    it, at most one per mesh dimension. A tensor sharded over two dimensions is summed
    over the first group, then over the second, which adds up the first sums: the whole.
    Every rank of a group holds the same tensor list with the same placements, so all
    issue the same all-reduces in the same order. Plain tensors are whole already.
    """
    rows_of: dict[dist.ProcessGroup, list[int]] = {}  # insertion order = order of first use
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, DTensor):
            for dim, placement in enumerate(tensor.placements):
                if not placement.is_replicate():
                    rows_of.setdefault(tensor.device_mesh.get_group(dim), []).append(i)
    for group, rows in rows_of.items():
        index = torch.tensor(rows, device=local.device)
        part = local.index_select(0, index)  # (rows, k)
        dist.all_reduce(part, group=group)
        local.index_copy_(0, index, part)
    return local


def local_tensor(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The plain tensor this rank holds (shares storage); a DTensor gradient first takes `like`'s layout.

    A gradient left Partial (pending a sum) would give a wrong norm and update, so it is
    redistributed to the parameter's placements; gradients already laid out like their
    parameter, as FSDP2 and the tensor-parallel layers leave them, pass through.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    if like is not None and tensor.placements != like.placements:
        tensor = tensor.redistribute(like.device_mesh, like.placements)
    return tensor.to_local()


class TrustRatioOptimizer(torch.optim.Optimizer):
    """Shared step of LAMB and LARS; subclasses give the direction, the ratio and the update.

    A step: `direction` per tensor (updates moments; returns x, the vector whose norm the
    ratio uses), then one `SquareSums` call for all adapted tensors, then `ratio` from the
    whole norms and `apply` per tensor. The elementwise work runs on local tensors: a
    DTensor op per tensor would cost a dispatch each, as much as the arithmetic on a
    small model, and the math is elementwise anyway.
    """

    def __init__(self, params, defaults: dict, square_sums: SquareSums | None = None):
        super().__init__(params, defaults)
        self.square_sums = square_sums or whole_square_sums

    def direction(self, group: dict, state: dict, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Update the state from local g; return x (shaped like the local w), whose norm `ratio` uses."""
        raise NotImplementedError

    def ratio(self, group: dict, w_norm: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
        """The trust ratio from the whole tensor's norms (0-dim tensors); undefined values become 1."""
        raise NotImplementedError

    def apply(self, group: dict, state: dict, w: torch.Tensor, x: torch.Tensor, ratio: torch.Tensor) -> None:
        """Update the local w in place, scaled by `ratio` (0-dim; 1 for groups with adapt False)."""
        raise NotImplementedError

    def init_state(self, param: torch.Tensor) -> dict:
        """A parameter's state before its first step (nvme offload supplies its own, zero-filled)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, state, local w, local x, index of its row in the norms or None)
        owners, squares = [], []  # adapted tensors as held, and their local sums of squares (2,)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.init_state(p))
                w = local_tensor(p)
                x = self.direction(group, state, w, local_tensor(p.grad, like=p))
                row = None
                if group["adapt"]:
                    row = len(owners)
                    owners.append(p)
                    squares.append(torch.stack([_square_sum(w), _square_sum(x)]))
                work.append((group, state, w, x, row))
        ratios = None
        if owners:
            sums = self.square_sums(owners, torch.stack(squares))  # (n, 2)
            norms = sums.sqrt()
            ratios = [self._bounded(group, self.ratio(group, norms[row, 0], norms[row, 1]))
                      for group, _, _, _, row in work if row is not None]
        one = None
        for group, state, w, x, row in work:
            if row is None:
                one = one if one is not None else torch.ones((), device=w.device)
                self.apply(group, state, w, x, one)
            else:
                self.apply(group, state, w, x, ratios[row].to(w.dtype))
        return loss

    @staticmethod
    def _bounded(group: dict, ratio: torch.Tensor) -> torch.Tensor:
        """1 where the ratio is undefined (a zero weight: 0 or nan; a zero denominator: inf); at most trust_clip (if > 0)."""
        ratio = torch.where(torch.isfinite(ratio) & (ratio > 0), ratio, torch.ones_like(ratio))
        return ratio.clamp(max=group["trust_clip"]) if group["trust_clip"] > 0 else ratio


def _square_sum(t: torch.Tensor) -> torch.Tensor:
    """sum(t^2) in at least fp32: a bf16/fp16 sum over a large tensor would lose the norm."""
    return t.to(torch.promote_types(t.dtype, torch.float32)).square().sum()
