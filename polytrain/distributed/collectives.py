"""Collectives, counted, and the autograd-aware pairs that model parallelism is built from.

Two layers:

- Plain collectives (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `exchange`, ...):
  out-of-place wrappers over torch.distributed on any process group. Each one records
  what it cost in every active `comm_stats()` counter: the call, the bytes this rank
  sends under the ring algorithm, and the global ranks it talks to.
- Autograd functions named for the region they move a tensor into, each the other's
  mirror in backward (Megatron-LM's f/g operators, Shoeybi et al. 2019 and
  Korthikanti et al. 2022):

      copy_to_tp          forward identity          backward all-reduce
      reduce_from_tp      forward all-reduce        backward identity
      gather_from_sp      forward all-gather        backward reduce-scatter
      reduce_scatter_to_sp forward reduce-scatter   backward all-gather
      scatter_to_sp       forward keep own slice    backward all-gather
      gather_from_tp      forward all-gather        backward keep own slice
      sum_across          forward all-reduce        backward all-reduce

  The "tp"/"sp" in the names say which region the tensor enters or leaves; the group
  is an argument, so the same functions serve any axis (tp, a 2D grid's rows, ...).

Counting (process-local, nestable, off unless a counter is active):

    with comm_stats() as stats:
        loss.backward()
    stats.kinds["all_reduce"].bytes_sent, stats.total_bytes, stats.peers

Bytes sent per rank, for a group of n ranks and a tensor of b bytes (ring algorithms):
all-reduce 2(n-1)/n * b, all-gather (n-1)/n * output bytes, reduce-scatter (n-1)/n *
input bytes, all-to-all (n-1)/n * b, broadcast b from the source, an exchange's send b. A group of one
rank sends nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from polytrain.backend import host_collective_ops, host_collectives

# ----- counting -------------------------------------------------------------------------


@dataclass
class KindStats:
    """One collective kind's tally."""

    calls: int = 0
    bytes_sent: float = 0.0
    peers: set[int] = field(default_factory=set)


@dataclass
class CommStats:
    """What this process sent while the counter was active, per collective kind."""

    kinds: dict[str, KindStats] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return sum(k.bytes_sent for k in self.kinds.values())

    @property
    def calls(self) -> int:
        return sum(k.calls for k in self.kinds.values())

    @property
    def peers(self) -> set[int]:
        return set().union(*(k.peers for k in self.kinds.values()))

    def as_dict(self) -> dict[str, dict]:
        return {name: {"calls": k.calls, "bytes_sent": k.bytes_sent, "peers": sorted(k.peers)}
                for name, k in sorted(self.kinds.items())}


_counters: list[CommStats] = []


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Count every collective of this module run inside the block (in this process)."""
    stats = CommStats()
    _counters.append(stats)
    try:
        yield stats
    finally:
        _counters.remove(stats)


def _group_peers(group: ProcessGroup | None) -> tuple[int, ...]:
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return tuple(r for r in ranks if r != dist.get_rank())


def record(kind: str, bytes_sent: float, peers: tuple[int, ...] | set[int]) -> None:
    """Add one call of `kind` to every active counter (for collectives issued elsewhere)."""
    for stats in _counters:
        k = stats.kinds.setdefault(kind, KindStats())
        k.calls += 1
        k.bytes_sent += bytes_sent
        k.peers.update(peers)


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----- plain collectives (out of place, counted) ------------------------------------------


def all_reduce(x: torch.Tensor, group: ProcessGroup | None,
               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor holding the reduction of `x` over `group` (x itself is left alone)."""
    n = group_size(group)
    if n == 1:
        return x.clone(memory_format=torch.contiguous_format)
    if _counters:
        record("all_reduce", 2 * (n - 1) / n * _nbytes(x), _group_peers(group))
    if op == dist.ReduceOp.SUM and _traced_host(x):
        return host_collective_ops.host_all_reduce(x, host_collective_ops.group_name(group))
    if op == dist.ReduceOp.SUM and (out := host_collectives.all_reduce(x, group)) is not None:
        return out  # summed through shared memory at once, from x into a new tensor
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def _traced_host(x: torch.Tensor) -> bool:
    """Whether a graph being compiled should call the shared-memory operators for `x`
    (backend/host_collective_ops.py) rather than trace the process group's collective."""
    return torch.compiler.is_compiling() and host_collectives.may_share(x)


def start_all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, dist.Work | None]:
    """all_reduce (sum) started, not waited for: (the new tensor, its work); read it after work.wait().

    The work is None for a group of one rank, or where the sum ran at once through shared
    memory (nothing to wait for). Eager only: a compiled graph traces the blocking all_reduce above.
    """
    n = group_size(group)
    if n == 1:
        return x.clone(memory_format=torch.contiguous_format), None
    if _counters:
        record("all_reduce", 2 * (n - 1) / n * _nbytes(x), _group_peers(group))
    if (out := host_collectives.all_reduce(x, group)) is not None:
        return out, None
    out = x.clone(memory_format=torch.contiguous_format)
    return out, dist.all_reduce(out, group=group, async_op=True)


def all_gather(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in group-rank order: (.., s, ..) -> (.., n*s, ..)."""
    n = group_size(group)
    if n == 1:
        return x.clone()
    if _counters:
        record("all_gather", (n - 1) * _nbytes(x), _group_peers(group))  # (n-1)/n of the gathered bytes
    flat = x.contiguous().view(-1)
    if _traced_host(x):
        name = host_collective_ops.group_name(group)
        stacked = host_collective_ops.host_all_gather(flat, n, name).view(n, *x.shape)
    else:
        stacked = x.new_empty((n, *x.shape))  # (n, ..., s, ...): one contiguous slot per rank
        if not host_collectives.all_gather_(stacked.view(-1), flat, group):
            dist.all_gather_single(stacked.view(-1), flat, group=group)
    dim = dim % x.dim()
    return stacked.movedim(0, dim).flatten(dim, dim + 1)  # (..., n, s, ...) -> (..., n*s, ...)


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: list[int],
                      group: ProcessGroup | None) -> torch.Tensor:
    """all_gather where rank r holds sizes[r] entries along `dim` (e.g. torch.chunk shards)."""
    largest = max(sizes)
    if all(s == largest for s in sizes):
        return all_gather(x, dim, group)
    dim = dim % x.dim()
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, largest - x.shape[dim]]
    gathered = all_gather(torch.nn.functional.pad(x, pad), dim, group)  # (..., n*largest, ...)
    pieces = gathered.split(largest, dim)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(pieces, sizes)], dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/n slice of `dim`: (.., n*s, ..) -> (.., s, ..)."""
    if group_size(group) == 1:
        return x.clone()
    blocks, out = _reduce_scatter_buffers(x, dim, group)
    if _traced_host(x):
        name, n = host_collective_ops.group_name(group), group_size(group)
        return host_collective_ops.host_reduce_scatter(blocks.view(-1), n, name).view(out.shape)
    if not host_collectives.reduce_scatter_(out.view(-1), blocks.view(-1), group):
        dist.reduce_scatter_single(out.view(-1), blocks.view(-1), group=group)
    return out


def start_reduce_scatter(x: torch.Tensor, dim: int,
                         group: ProcessGroup | None) -> tuple[torch.Tensor, dist.Work | None]:
    """reduce_scatter started, not waited for: (this rank's slice, its work), as start_all_reduce."""
    if group_size(group) == 1:
        return x.clone(), None
    blocks, out = _reduce_scatter_buffers(x, dim, group)
    if host_collectives.reduce_scatter_(out.view(-1), blocks.view(-1), group):
        return out, None
    return out, dist.reduce_scatter_single(out.view(-1), blocks.view(-1), group=group, async_op=True)


def _reduce_scatter_buffers(x: torch.Tensor, dim: int,
                            group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x laid out as n contiguous per-rank blocks, this rank's output buffer); counts the call."""
    n = group_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by the group's {n} ranks")
    # (n, ..., s, ...): rank r's slice of dim becomes the r-th contiguous block
    blocks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    if _counters:
        record("reduce_scatter", (n - 1) / n * _nbytes(blocks), _group_peers(group))
    return blocks, x.new_empty(blocks.shape[1:])


def broadcast(x: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """`x` of global rank `src`, on every rank of `group` (a new tensor)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if group_size(group) == 1:
        return out
    if _counters:
        sender = dist.get_rank() == src
        record("broadcast", _nbytes(x) if sender else 0, _group_peers(group) if sender else (src,))
    dist.broadcast(out, src=src, group=group)
    return out


def all_to_all(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """x (n, ...): slot j goes to group rank j; returns (n, ...) whose slot j came from rank j."""
    n = group_size(group)
    if x.shape[0] != n:
        raise ValueError(f"all_to_all: leading size {x.shape[0]} must equal the group's {n} ranks")
    if n == 1:
        return x.clone()
    x = x.contiguous()
    if _counters:
        record("all_to_all", (n - 1) / n * _nbytes(x), _group_peers(group))
    if _traced_host(x):
        return host_collective_ops.host_all_to_all(x, host_collective_ops.group_name(group))
    out = torch.empty_like(x)
    if not host_collectives.all_to_all_(out, x, group):
        dist.all_to_all_single(out, x, group=group)
    return out


class Exchange:
    """The works of one posted batch of point-to-point operations; `wait()` finishes them all."""

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]):
        self._works, self._tensors = works, tensors  # the tensors live until the transfer is done

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], []


def exchange(sends: Sequence[tuple[torch.Tensor, int]] = (), recvs: Sequence[tuple[torch.Tensor, int]] = (),
             group: ProcessGroup | None = None) -> Exchange:
    """Post point-to-point sends (tensor, global dst) and receives (buffer, global src) as ONE batch.

    Every point-to-point transfer in polytrain goes through here (tests/unit/test_p2p_batched.py
    keeps it so), because of how the GPU collective library matches them: by posting order per
    peer, ignoring tags, and an unbatched send to a peer that is also being received from can
    hang once messages outgrow its buffers. One `batch_isend_irecv` per call lets the library
    run the batch's sends and receives together; peers must post their batches in the same
    order, each side listing its operations with a peer in the same order as the peer lists the
    opposite ones (tag 0 always). Returns at once: keep the tensors alive and unchanged (sends)
    and unread (receives) until `wait()`, e.g. to overlap the transfer with compute.
    """
    ops = []
    for x, dst in sends:
        if _counters:
            record("send", _nbytes(x), (dst,))
        ops.append(dist.P2POp(dist.isend, x.contiguous(), dst, group))
    for x, src in recvs:
        if _counters:
            record("recv", 0, (src,))
        ops.append(dist.P2POp(dist.irecv, x, src, group))
    return Exchange(dist.batch_isend_irecv(ops) if ops else [], [op.tensor for op in ops])


# ----- autograd pairs ---------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient over the group.

    Megatron's f: the input of a column-parallel region is used by every rank with a
    different slice of the weights, so its gradient is the sum of the ranks' parts.
    Also used on a replicated weight whose uses differ per rank (sequence-parallel
    norms, shared KV heads): its gradient is likewise the sum of the ranks' parts.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group. Backward: identity.

    Megatron's g: a row-parallel layer leaves each rank a partial sum of the output.
    """

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """Forward: all-gather the sequence shards along `dim`. Backward: reduce-scatter along `dim`.

    Enters a tensor-parallel region from a sequence-parallel one: (B, T/n, D) -> (B, T, D).
    The gradient of the full sequence is partial on each rank (each used its weight
    slice), so backward sums it and hands each rank its own shard's part.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Forward: reduce-scatter along `dim`. Backward: all-gather along `dim`.

    Leaves a row-parallel region into a sequence-parallel one: partial (B, T, D) ->
    summed (B, T/n, D), replacing the all-reduce of plain tensor parallelism.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _ScatterToSP(torch.autograd.Function):
    """Forward: keep this rank's 1/n slice along `dim`. Backward: all-gather along `dim`.

    Splits a replicated tensor into sequence shards without communication.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        n = group_size(group)
        if x.shape[dim] % n:
            raise ValueError(f"scatter_to_sp: size {x.shape[dim]} of dim {dim} is not divisible by {n} ranks")
        return x.chunk(n, dim)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather shards of possibly different sizes along `dim`. Backward: keep own slice.

    Collects a tensor split over the group (e.g. vocabulary-parallel logits for sampling).
    """

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, group_rank(group)
        return all_gather_uneven(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[:ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]).contiguous(), None, None, None


class _SumAcross(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: all-reduce (sum) the gradient.

    A sum every rank uses downstream with a different gradient: the statistics of a
    norm whose hidden features are split over the group (2D/2.5D/3D grids). Each
    rank's part of the sum feeds every rank's output, so its gradient is the sum of them.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward identity, backward all-reduce (see _CopyToTP)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward all-reduce, backward identity (see _ReduceFromTP)."""
    return _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Forward all-gather along `dim`, backward reduce-scatter (see _GatherFromSP)."""
    return _GatherFromSP.apply(x, dim, group)


def reduce_scatter_to_sp(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Forward reduce-scatter along `dim`, backward all-gather (see _ReduceScatterToSP)."""
    return _ReduceScatterToSP.apply(x, dim, group)


def scatter_to_sp(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Forward keep own slice of `dim`, backward all-gather (see _ScatterToSP)."""
    return _ScatterToSP.apply(x, dim, group)


def gather_from_tp(x: torch.Tensor, dim: int, sizes: list[int], group: ProcessGroup | None) -> torch.Tensor:
    """Forward all-gather of shards sized `sizes` along `dim`, backward keep own slice (see _GatherFromTP)."""
    return _GatherFromTP.apply(x, dim, sizes, group)


def sum_across(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward all-reduce, backward all-reduce (see _SumAcross)."""
    return _SumAcross.apply(x, group)
