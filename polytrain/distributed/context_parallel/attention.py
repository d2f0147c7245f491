"""Context-parallel attention: the replacement for Attention.core on a sharded sequence.

    cp = ContextParallel(groups)                  # groups: layout.new_cp_groups / the mesh's
    cp.apply(model)                               # every block's attention.core, in place
    cp.documents = ids                            # (B, T) whole-batch ids of packed docs, or None
    model(cp.shard(tokens), positions=cp.shard(positions), documents=cp.shard(ids))

Each rank's tokens are the layout's slots (layout.py). Modes, by the groups' degrees:
- ulysses (ring 1): all-to-all to head shards, attention over the whole sequence, back;
- ring (ulysses 1): K/V shards around the ring, LSE-merged (ring.py);
- hybrid: Ulysses inside groups of `ulysses` ranks, then a ring across the groups on the
  H/ulysses heads each rank holds (USP, Fang and Zhao 2024; LoongTrain's head x context).
With one rank it is the single-device blockwise kernel. The ring computes blockwise (its
partial results carry their log-sum-exp) in O(T/P) memory; Ulysses attends over whole
sequences in O(T), with SDPA's fused kernel for plain causal masks and blockwise for
packed documents (whose dense mask SDPA would need).

The document ids of the whole batch are set per batch (every rank of a cp group reads the
same batch), so no rank needs to be sent another's: the core reads the ids of any slot.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from polytrain.distributed.context_parallel.decode import decode_attention
from polytrain.distributed.context_parallel.layout import CPGroups, Layout
from polytrain.distributed.context_parallel.ring import RingPlan, ring_attention
from polytrain.distributed.context_parallel.ulysses import heads_to_seq, seq_to_heads, spread_kv
from polytrain.models.common.blockwise_attention import auto_block
from polytrain.models.common.documents import DocumentMask


class ContextParallel:
    """Attention of one model whose sequences are split over a cp group (module docstring)."""

    def __init__(self, groups: CPGroups, block: int | None = None):
        """block: the blockwise kernel's rows per tile (default: auto_block's for the shapes)."""
        self.groups = groups
        self.block = block
        self.documents: torch.Tensor | None = None
        """(B, T) document ids of the batch being run, whole sequences; None = one document per row."""
        self.decoding = False
        """True while generating over a ShardedKVCache: each call brings one token, the same on every rank."""
        self.batch = None
        """The current batch's positions and document ids for this rank (apply.begin_batch), or None."""

    @property
    def mode(self) -> str:
        g = self.groups
        if g.size == 1:
            return "blockwise"
        return "ulysses" if g.ring_size == 1 else "ring" if g.ulysses_size == 1 else "hybrid"

    def layout(self, seq_len: int) -> Layout:
        return self.groups.layout(seq_len)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `x` (the whole sequence along `dim`)."""
        return self.layout(x.shape[dim]).shard(x, self.groups.cp_rank, dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, T/P, D), k and v (B, Hkv, T/P, D) of this rank's slots -> (B, H, T/P, D).

        documents: (B, T) ids of the whole sequences (packed documents), or None.
        """
        g = self.groups
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        layout = self.layout(q.shape[2] * g.size)
        if documents is not None and documents.shape[1] != layout.seq_len:
            raise ValueError(f"document ids cover {documents.shape[1]} tokens; the sharded sequence "
                             f"has {layout.seq_len}")
        if q.shape[1] % g.ulysses_size:
            raise ValueError(f"{q.shape[1]} query heads cannot be split over Ulysses degree {g.ulysses_size}")
        if g.ulysses_size > 1:  # sequence shards -> head shards of the ring rank's slots
            q = seq_to_heads(q, g.ulysses)
            k = seq_to_heads(spread_kv(k, g.ulysses_size), g.ulysses)
            v = seq_to_heads(spread_kv(v, g.ulysses_size), g.ulysses)
        if g.ring_size == 1 and documents is None:
            out = _whole_sequence(q, k, v, causal, scale)  # no partial results to merge: SDPA's fused kernel
        else:
            docs = None if documents is None else documents.to(q.device)
            slots = [layout.ring_slots(r).to(q.device) for r in range(g.ring_size)]
            block = _tile(layout, self.block or auto_block(q.shape[0], q.shape[1]))
            out = ring_attention(q, k, v, RingPlan(g, slots, docs, causal, scale, block))
        return heads_to_seq(out, g.ulysses) if g.ulysses_size > 1 else out

    def core_for(self, attention: nn.Module):
        """A function with Attention.core's contract (q, k, v, mask) running on the cp group."""

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
            if attention.training and attention.dropout > 0:
                raise ValueError("context-parallel attention has no attention-weight dropout; "
                                 "set model.dropout = 0")
            if self.decoding:
                scale = 1.0 / math.sqrt(q.shape[-1]) if attention.scale is None else attention.scale
                return decode_attention(q, k, v, scale, self.groups)
            if mask is not None and not isinstance(mask, DocumentMask):
                raise ValueError("context-parallel attention takes causal and packed-document masks, "
                                 "not a dense mask (KV-cache decoding runs through the sharded cache)")
            documents = None
            if isinstance(mask, DocumentMask):
                if self.documents is None:
                    raise ValueError("packed documents under context parallelism: set "
                                     "ContextParallel.documents to the whole batch's ids before the forward")
                documents = self.documents
            return self.attention(q, k, v, attention.causal, attention.scale, documents)

        return core

    def apply(self, model: nn.Module) -> None:
        """Replace the attention core of every block in `model.layers` (before TP and checkpointing wrap it)."""
        for block in model.layers.values():
            block.attention.core = self.core_for(block.attention)


def _whole_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Plain causal (or full) attention over whole sequences in slot order (Ulysses without a ring):
    SDPA's fused kernels, which keep no (T, T) tensor when no mask is given."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _tile(layout: Layout, block: int) -> int:
    """Tile rows: at most `block`, dividing a zigzag chunk evenly where that is possible,
    so tiles do not straddle two chunks and the causal skips stay whole."""
    chunk = layout.seq_len // (2 * layout.ring) if layout.ring > 1 else layout.seq_len
    return math.ceil(chunk / math.ceil(chunk / block))
