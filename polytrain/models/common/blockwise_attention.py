"""Attention in O(T) memory: tiles of queries x keys with an online softmax (FlashAttention's
recurrence, Dao et al. 2022/2023), written in plain PyTorch so it runs on every device.

No (T, T) tensor is ever built, in forward or backward:

- forward walks key tiles for each query tile, keeping a running maximum m, denominator l
  and unnormalised output; it returns the output and the log-sum-exp lse = m + log l of
  every query row (fp32, or fp64 for fp64 inputs), which is what lets partial results over
  different keys be merged exactly (ring attention) and backward be recomputed;
- backward (`attention_backward`) recomputes each tile's probabilities from q, k and lse,
  p = exp(s - lse), and accumulates dq, dk, dv from delta = rowsum(dout * out).

Which keys a query sees is a `Visibility`: causality by global slot numbers (so a shard of
a sequence, in any order, knows which of another shard's keys precede it) and packed
documents by id. Tiles that no query of theirs can see are skipped (the upper triangle of a
causal sequence, other documents' tiles), and tiles every query sees whole need no mask.
Grouped-query attention runs without repeating keys: the query heads of one key head are
stacked as extra rows of that head's tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from polytrain.models.common.documents import DocumentMask

TILE_SCORES = 1 << 18
"""Scores per tile, over the batch and heads together (1 MiB in fp32) when the tile size is
left to `auto_block`: small enough to stay in a core's cache across the tile's elementwise
passes (max, exp, sum), which on a CPU cost more than its two matmuls."""
_SKIP = "skip"


@dataclass(frozen=True)
class Visibility:
    """Which keys each query may see.

    q_slots (Tq,) / k_slots (Tk,): global position of each query / key in its sequence; with
    causal, a query sees keys at slots <= its own. q_docs (B, Tq) / k_docs (B, Tk): document
    ids; when given, a query sees only keys of its own document.
    """

    causal: bool
    q_slots: torch.Tensor
    k_slots: torch.Tensor
    q_docs: torch.Tensor | None = None
    k_docs: torch.Tensor | None = None

    @classmethod
    def of_sequence(cls, n_queries: int, n_keys: int, causal: bool, device: torch.device,
                    documents: torch.Tensor | None = None) -> Visibility:
        """One whole sequence: the queries are its last n_queries slots (all of them without a cache)."""
        k_slots = torch.arange(n_keys, device=device)
        docs = None if documents is None else documents[:, -n_queries:]
        return cls(causal, k_slots[n_keys - n_queries:], k_slots, docs, documents)

    def tiles(self, block_q: int, block_k: int) -> _Tiles:
        return _Tiles(self, block_q, block_k)


class _Tiles:
    """Per-tile verdicts of a Visibility: skip, see all, or the (B or 1, 1, 1, tq, tk) boolean mask."""

    def __init__(self, vis: Visibility, block_q: int, block_k: int):
        self.vis, self.bq, self.bk = vis, block_q, block_k
        self.q_bounds = _bounds(len(vis.q_slots), block_q)
        self.k_bounds = _bounds(len(vis.k_slots), block_k)
        # min/max per tile as Python numbers: one small reduction per tile, done once.
        self.q_slot = _ranges(vis.q_slots, block_q)
        self.k_slot = _ranges(vis.k_slots, block_k)
        self.q_doc = _ranges(vis.q_docs, block_q) if vis.q_docs is not None else None
        self.k_doc = _ranges(vis.k_docs, block_k) if vis.k_docs is not None else None

    def verdict(self, i: int, j: int) -> torch.Tensor | str | None:
        """_SKIP, None (every query sees every key) or the mask of query tile i x key tile j."""
        vis, full = self.vis, True
        if vis.causal:
            (q_lo, q_hi), (k_lo, k_hi) = self.q_slot[i], self.k_slot[j]
            if k_lo > q_hi:
                return _SKIP
            full = k_hi <= q_lo
        if self.q_doc is not None:
            (q_lo, q_hi), (k_lo, k_hi) = self.q_doc[i], self.k_doc[j]  # (B,) lists each
            rows = list(zip(q_lo, q_hi, k_lo, k_hi))
            if all(qh < kl or ql > kh for ql, qh, kl, kh in rows):
                return _SKIP
            full = full and all(ql == qh == kl == kh for ql, qh, kl, kh in rows)
        if full:
            return None
        (qs, qe), (ks, ke) = self.q_bounds[i], self.k_bounds[j]
        mask = torch.ones(1, qe - qs, ke - ks, dtype=torch.bool, device=vis.q_slots.device)
        if vis.causal:
            mask = mask & (vis.k_slots[None, None, ks:ke] <= vis.q_slots[None, qs:qe, None])
        if self.q_doc is not None:
            mask = mask & (vis.q_docs[:, qs:qe, None] == vis.k_docs[:, None, ks:ke])  # (B, tq, tk)
        return mask[:, None, None]  # (B or 1, 1, 1, tq, tk): broadcast over key heads and their query groups


def _bounds(n: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, n)) for s in range(0, n, block)]


def _ranges(x: torch.Tensor, block: int) -> list[tuple]:
    """Per tile of the last dim: (min, max) of x, numbers for (T,) and per-row lists for (B, T)."""
    if x.shape[-1] == 0:  # no keys (an empty cache shard): no tiles
        return []
    lo = torch.stack([t.amin(-1) for t in x.split(block, dim=-1)]).tolist()
    hi = torch.stack([t.amax(-1) for t in x.split(block, dim=-1)]).tolist()
    return list(zip(lo, hi))


def auto_block(batch: int, heads: int) -> int:
    """Query and key rows per tile: a power of two in [64, 1024] near sqrt(TILE_SCORES / (B x H))."""
    side = math.isqrt(max(TILE_SCORES // max(batch * heads, 1), 1))
    return max(64, min(1024, 1 << (side.bit_length() - 1)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit inputs, fp64 stays fp64


def _query_tiles(x: torch.Tensor, n_kv: int, bounds: list[tuple[int, int]], dtype: torch.dtype):
    """(B, H, T, ...) -> per query tile (B, Hkv, rep * tq, ...): each key head's query heads stacked as rows."""
    B, H = x.shape[:2]
    grouped = x.reshape(B, n_kv, H // n_kv, *x.shape[2:])  # (B, Hkv, rep, T, ...)
    return [grouped[:, :, :, s:e].to(dtype).flatten(2, 3) for s, e in bounds]


def _masked(scores: torch.Tensor, verdict, rep: int) -> torch.Tensor:
    """Scores (B, Hkv, rep * tq, tk) with invisible keys at -inf (in place)."""
    if verdict is not None:
        B, n_kv, rows, tk = scores.shape
        scores.view(B, n_kv, rep, rows // rep, tk).masked_fill_(~verdict, float("-inf"))
    return scores


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, scale: float,
                      block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, Tq, D), k and v (B, Hkv, Tk, D) -> out (B, H, Tq, D) fp32 (fp64 for fp64 inputs)
    and lse (B, H, Tq) in the same dtype. A query that sees no key gets out 0 and lse -inf.
    block: rows per tile (default auto_block's)."""
    B, H, Tq, D = q.shape
    n_kv, dtype = k.shape[1], _compute_dtype(q)
    rep = H // n_kv
    block = block or auto_block(B, H)
    tiles = vis.tiles(block, block)
    k_tiles = [k[:, :, s:e].to(dtype) for s, e in tiles.k_bounds]  # (B, Hkv, tk, D) each
    v_tiles = [v[:, :, s:e].to(dtype) for s, e in tiles.k_bounds]
    outs, lses = [], []
    for i, qt in enumerate(_query_tiles(q, n_kv, tiles.q_bounds, dtype)):  # (B, Hkv, rep * tq, D)
        qt = qt * scale
        m = qt.new_full(qt.shape[:-1], float("-inf"))  # running max (B, Hkv, rep * tq)
        l = qt.new_zeros(qt.shape[:-1])  # running denominator
        acc = qt.new_zeros(qt.shape[:-1] + v.shape[-1:])  # unnormalised output (B, Hkv, rep * tq, D)
        for j, (kt, vt) in enumerate(zip(k_tiles, v_tiles)):
            verdict = tiles.verdict(i, j)
            if verdict is _SKIP:
                continue
            s = _masked(qt @ kt.transpose(-1, -2), verdict, rep)  # (B, Hkv, rep * tq, tk)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that saw no key yet
            p = s.sub_(m_safe[..., None]).exp_()  # in place: the tile is the largest tensor here
            correction = torch.exp(m - m_safe)  # 0 where m was -inf
            l = l * correction + p.sum(-1)
            acc = acc.mul_(correction[..., None]).add_(p @ vt)
            m = m_new
        outs.append(acc / l.masked_fill(l == 0, 1.0)[..., None])
        lses.append(m + torch.log(l))  # -inf where no key was visible
    tq = [e - s for s, e in tiles.q_bounds]
    out = torch.cat([o.unflatten(2, (rep, n)) for o, n in zip(outs, tq)], dim=3)  # (B, Hkv, rep, Tq, D)
    lse = torch.cat([x.unflatten(2, (rep, n)) for x, n in zip(lses, tq)], dim=3)
    return out.reshape(B, H, Tq, -1), lse.reshape(B, H, Tq)


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, dout: torch.Tensor, vis: Visibility, scale: float,
                       block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention_forward`'s output, recomputed tile by tile.

    `out` and `lse` (B, H, Tq[, D]) are those of the whole attention over every key the queries
    see, which may span more keys than k and v here (ring attention calls this once per key
    shard). Returns dq (B, H, Tq, D), dk and dv (B, Hkv, Tk, D), in the compute dtype.
    """
    B, H, Tq, D = q.shape
    n_kv, dtype = k.shape[1], _compute_dtype(q)
    rep = H // n_kv
    block = block or auto_block(B, H)
    tiles = vis.tiles(block, block)
    q_tiles = [t * scale for t in _query_tiles(q, n_kv, tiles.q_bounds, dtype)]  # (B, Hkv, rep * tq, D)
    do_tiles = _query_tiles(dout, n_kv, tiles.q_bounds, dtype)
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)  # (B, H, Tq): rowsum(dout * out)
    delta_tiles = _query_tiles(delta, n_kv, tiles.q_bounds, dtype)  # (B, Hkv, rep * tq)
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0)  # rows that see nothing: p = exp(-inf) = 0
    lse_tiles = _query_tiles(lse_safe, n_kv, tiles.q_bounds, dtype)
    dq_tiles = [torch.zeros_like(t) for t in q_tiles]
    dks, dvs = [], []
    for j, (ks, ke) in enumerate(tiles.k_bounds):
        kt, vt = k[:, :, ks:ke].to(dtype), v[:, :, ks:ke].to(dtype)  # (B, Hkv, tk, D)
        dk, dv = torch.zeros_like(kt), torch.zeros_like(vt)
        for i, qt in enumerate(q_tiles):
            verdict = tiles.verdict(i, j)
            if verdict is _SKIP:
                continue
            s = _masked(qt @ kt.transpose(-1, -2), verdict, rep)  # (B, Hkv, rep * tq, tk)
            p = s.sub_(lse_tiles[i][..., None]).exp_()
            dv += p.transpose(-1, -2) @ do_tiles[i]
            ds = (do_tiles[i] @ vt.transpose(-1, -2)).sub_(delta_tiles[i][..., None]).mul_(p)
            dq_tiles[i] += ds @ kt
            dk += ds.transpose(-1, -2) @ qt  # qt carries the scale already
        dks.append(dk)
        dvs.append(dv)
    tq = [e - s for s, e in tiles.q_bounds]
    dq = torch.cat([t.unflatten(2, (rep, n)) for t, n in zip(dq_tiles, tq)], dim=3).reshape(B, H, Tq, D)
    return dq * scale, torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


class _BlockwiseAttention(torch.autograd.Function):
    """Saves q, k, v, out and lse (all O(T)) and recomputes the tiles in backward."""

    @staticmethod
    def forward(ctx, q, k, v, vis, scale, block):
        out, lse = attention_forward(q, k, v, vis, scale, block)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.vis, ctx.scale, ctx.block = vis, scale, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, ctx.vis, ctx.scale, ctx.block)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility,
                        scale: float | None = None, block: int | None = None) -> torch.Tensor:
    """softmax(scale q k^T, keys `vis` hides at -inf) v in O(T) memory, differentiable.

    q (B, H, Tq, D), k and v (B, Hkv, Tk, D) with Hkv dividing H -> (B, H, Tq, D) in q's dtype.
    scale defaults to 1/sqrt(D), block (rows per tile) to auto_block's.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads must divide {q.shape[1]} query heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _BlockwiseAttention.apply(q, k, v, vis, scale, block)


def blockwise_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, *, causal: bool,
                   scale: float | None, block: int | None = None) -> torch.Tensor:
    """Attention.core's contract (mask None or a DocumentMask) on the blockwise kernel."""
    if mask is not None and not isinstance(mask, DocumentMask):
        raise ValueError("blockwise attention takes causal / document masks only, not a dense mask tensor")
    docs = mask.ids if mask is not None else None
    vis = Visibility.of_sequence(q.shape[2], k.shape[2], causal, q.device, docs)
    return blockwise_attention(q, k, v, vis, scale, block)
