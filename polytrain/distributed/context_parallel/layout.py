"""Which tokens of a sequence each context-parallel rank holds, and its process groups.

A cp group of P = ring x ulysses ranks; cp rank c = ring_rank x ulysses + ulysses_rank, so
each Ulysses group is ulysses consecutive cp ranks and the ring runs across the groups.

Zigzag (head-tail) balancing for causal attention: the sequence of T slots is cut into
2 x ring chunks and ring rank j holds chunks j and 2 x ring - 1 - j, so every ring rank
gets one early (cheap) and one late (expensive) chunk of the causal triangle. Ulysses
rank i of that ring rank holds the i-th 1/ulysses of those 2 chunks, so the Ulysses
all-to-all, which concatenates its group's tokens in rank order, gives back exactly the
ring rank's two chunks. With ring = 1 (pure Ulysses) rank i holds the i-th contiguous
1/P of the sequence; with ulysses = 1 (pure ring) the plain zigzag.

Every tensor along the sequence (tokens, targets, loss mask, positions, document ids) is
sharded with the same slots; positions keep their global values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from polytrain.distributed.collectives import all_gather, group_rank


@dataclass(frozen=True)
class Layout:
    """The slots of a T-token sequence over `ring` x `ulysses` cp ranks (module docstring)."""

    seq_len: int
    ring: int
    ulysses: int

    def __post_init__(self) -> None:
        if self.seq_len % self.divisor:
            raise ValueError(f"sequence length {self.seq_len} is not a multiple of {self.divisor} "
                             f"(ring {self.ring} x ulysses {self.ulysses})")

    @property
    def size(self) -> int:
        return self.ring * self.ulysses

    @property
    def divisor(self) -> int:
        """What seq_len must be a multiple of: 2 x ring chunks, each ring rank's split over ulysses."""
        if self.ring == 1:
            return self.ulysses
        chunks = 2 * self.ring
        per_ring_rank = 2  # chunks per ring rank, split into ulysses equal parts
        return chunks * self.ulysses // _gcd(per_ring_rank, self.ulysses)

    def ring_slots(self, ring_rank: int) -> torch.Tensor:
        """(T / ring,) slots ring rank j holds: chunks j and 2 x ring - 1 - j (all T when ring = 1)."""
        if self.ring == 1:
            return torch.arange(self.seq_len)
        chunk = self.seq_len // (2 * self.ring)
        head = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk)
        tail_start = (2 * self.ring - 1 - ring_rank) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])

    def slots(self, cp_rank: int) -> torch.Tensor:
        """(T / P,) slots of cp rank `cp_rank`, in the order it holds them."""
        ring_rank, ulysses_rank = divmod(cp_rank, self.ulysses)
        part = self.seq_len // self.size
        return self.ring_slots(ring_rank)[ulysses_rank * part:(ulysses_rank + 1) * part]

    def shard(self, x: torch.Tensor, cp_rank: int, dim: int = 1) -> torch.Tensor:
        """cp rank's part of `x`, whose `dim` is the whole sequence (T)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"shard: dim {dim} has {x.shape[dim]} entries, the layout is for {self.seq_len}")
        return x.index_select(dim, self.slots(cp_rank).to(x.device))

    def unshard(self, parts: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part concatenated in cp-rank order along `dim`."""
        order = torch.cat([self.slots(c) for c in range(self.size)]).to(parts.device)
        return parts.index_select(dim, torch.argsort(order))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@dataclass(frozen=True)
class CPGroups:
    """This rank's context-parallel process groups: the whole cp group, its Ulysses group
    (consecutive cp ranks) and its ring (one rank of every Ulysses group)."""

    cp: ProcessGroup | None
    ulysses: ProcessGroup | None
    ring: ProcessGroup | None
    ring_size: int
    ulysses_size: int

    @classmethod
    def single(cls) -> CPGroups:
        """No context parallelism: this rank alone holds its sequences."""
        return cls(None, None, None, 1, 1)

    @property
    def size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp) if self.size > 1 else 0

    @property
    def ring_rank(self) -> int:
        return group_rank(self.ring) if self.ring_size > 1 else 0

    def ring_peer(self, offset: int) -> int:
        """Global rank of the ring member `offset` places after this one."""
        return dist.get_global_rank(self.ring, (self.ring_rank + offset) % self.ring_size)

    def layout(self, seq_len: int) -> Layout:
        return Layout(seq_len, self.ring_size, self.ulysses_size)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of a sharded tensor (B, T/P, ...) along `dim`, on every cp rank."""
        if self.size == 1:
            return x
        layout = self.layout(x.shape[dim] * self.size)
        return layout.unshard(all_gather(x, dim, self.cp), dim)


def new_cp_groups(cp_groups: list[list[int]], ulysses: int) -> CPGroups:
    """CPGroups for this rank, given every cp group of the world (lists of global ranks in cp-rank
    order). Collective: every rank of the world calls it with the same lists."""
    me = dist.get_rank()
    size = len(cp_groups[0])
    if size % ulysses:
        raise ValueError(f"ulysses degree {ulysses} must divide the cp degree {size}")
    mine = {}
    for ranks in cp_groups:
        for kind, members in (("cp", [ranks]),
                              ("ulysses", [ranks[i:i + ulysses] for i in range(0, size, ulysses)]),
                              ("ring", [ranks[i::ulysses] for i in range(ulysses)])):
            for group_ranks in members:
                group = dist.new_group(group_ranks)
                if me in group_ranks:
                    mine[kind] = group
    return CPGroups(mine["cp"], mine["ulysses"], mine["ring"], size // ulysses, ulysses)
