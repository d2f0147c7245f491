"""Packed documents: attention that stays inside each token's own document.

A packed sequence holds several documents end to end; `ids` (B, T) says which document
each token belongs to (any integers: tokens attend to keys with the same id). Models take
the ids through `forward(..., documents=ids)` and hand attention a `DocumentMask`, which
each attention kernel reads in its own way: SDPA gets a dense boolean mask (T x T per
row), the blockwise kernel compares ids tile by tile and skips tiles that share no
document, so a long packed sequence never needs its (T, T) mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polytrain.models.common.kv_cache import KVCache


@dataclass(frozen=True)
class DocumentMask:
    """Queries attend only to keys of their own document; `ids` (B, T) int, queries and keys alike."""

    ids: torch.Tensor

    def dense(self, causal: bool) -> torch.Tensor:
        """Boolean (B, 1, T, T), True = may attend: same document (and key slot <= query slot if causal)."""
        same = self.ids[:, :, None] == self.ids[:, None, :]  # (B, T, T)
        if causal:
            T = self.ids.shape[1]
            same = same & torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()
        return same[:, None]


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position of each token inside its own document, counting from 0 at each change of id.

    The RoPE / learned positions of packed documents, so every document is encoded as if
    it stood alone at the start of a sequence.
    """
    B, T = ids.shape
    slots = torch.arange(T, device=ids.device).expand(B, T)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]  # (B, T): True where a document begins
    first = torch.where(starts, slots, torch.zeros_like(slots)).cummax(dim=1).values  # its first slot
    return slots - first


def attention_mask(seqlen: int, cache: KVCache | None, start_pos: int, documents: torch.Tensor | None,
                   device: torch.device):
    """What a decoder hands its attention layers: a DocumentMask for packed documents, the
    cache's mask (padding, offsets), or None (plain causal)."""
    if documents is not None:
        if cache is not None:
            raise ValueError("documents= masks packed sequences in a full pass; it cannot be combined with a KV cache")
        return DocumentMask(documents)
    return cache.attn_mask(start_pos, seqlen, device) if cache is not None else None
