"""Key/value cache for incremental decoding.

The cache covers `max_len` slots per row. A batch of prompts of different
lengths is left-padded: row b holds `pad[b]` padding slots before its first
real token. Padding is handled entirely here, so a model only needs
`forward(tokens, cache=..., start_pos=...)`:

- `attn_mask` hides padding slots from every real query;
- `positions` gives each token its position within its own row (slot - pad).
  RoPE attention depends only on relative positions, so this is not needed in
  exact arithmetic, but it makes each row use the very cos/sin values it uses
  alone, so batched and single-prompt results agree to rounding of the matmuls.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer keys and values, (B, n_kv_heads, max_len, head_dim) each, filled in place.

    A layer's buffers are allocated on its first `update`, with the dtype and device
    of the keys it writes: the cache then matches whatever precision the model
    computes in (fp32, autocast bf16, sharded low-precision parameters) and only
    holds layers this process actually runs.
    """

    def __init__(self, batch_size: int, max_len: int, pad: torch.Tensor | None = None):
        """`pad` (B,) int: left-padding slots per row; None when no row is padded."""
        if pad is not None and pad.shape != (batch_size,):
            raise ValueError(f"pad has shape {tuple(pad.shape)}, expected ({batch_size},)")
        self.batch_size = batch_size
        self.max_len = max_len
        self.pad = pad
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fixed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def fixed(self, layer: int, make) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values that do not grow with decoding (cross-attention over an encoder's
        output): `make()` computes them on the layer's first call, later calls reuse them."""
        if layer not in self._fixed:
            self._fixed[layer] = make()
        return self._fixed[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_heads, T, head_dim) at slots start_pos..start_pos+T-1.

        Returns all keys and values of slots 0..start_pos+T-1, (B, n_kv_heads, S, head_dim).
        """
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {end}")
        if layer not in self._kv:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self._kv[layer] = (k.new_zeros(shape), v.new_zeros(shape))
        cache_k, cache_v = self._kv[layer]
        cache_k[:, :, start_pos:end] = k
        cache_v[:, :, start_pos:end] = v
        return cache_k[:, :, :end], cache_v[:, :, :end]

    def positions(self, start_pos: int, seqlen: int, device: torch.device) -> torch.Tensor | None:
        """(B, T) RoPE position of each new token, or None when positions equal slots for all rows."""
        if self.pad is None:
            return None
        slots = torch.arange(start_pos, start_pos + seqlen, device=device)  # (T,)
        # Padding slots get position 0; their outputs are never used.
        return (slots[None, :] - self.pad.to(device)[:, None]).clamp(min=0)  # (B, T)

    def attn_mask(self, start_pos: int, seqlen: int, device: torch.device) -> torch.Tensor | None:
        """Boolean mask (B, 1, T, S), True = may attend, or None when plain causal attention is right.

        None is returned for unpadded rows when queries start at slot 0 (SDPA's
        is_causal) or are a single token (it sees every cached slot).
        """
        if self.pad is None and (start_pos == 0 or seqlen == 1):
            return None
        q_slot = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]  # (T, 1)
        k_slot = torch.arange(start_pos + seqlen, device=device)[None, :]  # (1, S)
        mask = k_slot <= q_slot  # (T, S) causal
        if self.pad is not None:
            real_key = k_slot >= self.pad.to(device)[:, None, None]  # (B, 1, S)
            # A padding query attends only to itself: some SDPA backends give NaN
            # for a row with no visible key, and NaN in a padding slot's value
            # leaks into real rows through 0 * NaN in the attention product.
            mask = mask & (real_key | (k_slot == q_slot))  # (B, T, S)
        else:
            mask = mask[None]  # (1, T, S)
        return mask[:, None]  # (B or 1, 1, T, S)


class StaticKVCache:
    """Fixed-shape keys and values for compiled, continuously refilled decoding.

    Buffers (B, n_kv_heads, max_len, head_dim) per layer, allocated once. Every row starts
    its sequence at slot 0 and advances on its own: `lengths[b]` is the slot row b writes
    next, so rows can hold prompts of any length and a finished row can take a new prompt
    while the others keep decoding. A decoding forward feeds one token per row and returns
    the whole buffers with a mask hiding each row's unwritten slots, so every step has the
    same shapes (one compiled graph); the model's `start_pos` is not used (the rows' own
    slots are). `row(b)` prefills row b's prompt through the ordinary cache interface.
    """

    def __init__(self, batch_size: int, max_len: int, device: torch.device | str = "cpu"):
        self.batch_size = batch_size
        self.max_len = max_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,) next slot per row
        self._slots = torch.arange(max_len, device=device)  # (S,)
        self._rows = torch.arange(batch_size, device=device)  # (B,)
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s (B, Hkv, S, D) key and value buffers, made like `like` (.., Hkv, T, D) at first use."""
        if layer not in self._kv:
            shape = (self.batch_size, like.shape[1], self.max_len, like.shape[3])
            self._kv[layer] = (like.new_zeros(shape), like.new_zeros(shape))
        return self._kv[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one token per row, k and v (B, Hkv, 1, D), at slot lengths[b]; returns the whole buffers."""
        if k.shape[2] != 1:
            raise ValueError("a static cache decodes one token per row; prefill rows with cache.rows(bs)")
        cache_k, cache_v = self.buffers(layer, k)
        cache_k[self._rows, :, self.lengths] = k[:, :, 0]  # (B, Hkv, D) into slot lengths[b] of row b
        cache_v[self._rows, :, self.lengths] = v[:, :, 0]
        return cache_k, cache_v

    def positions(self, start_pos: int, seqlen: int, device: torch.device) -> torch.Tensor:
        """(B, 1) each row's position: its slot (rows start at slot 0)."""
        return self.lengths[:, None]

    def attn_mask(self, start_pos: int, seqlen: int, device: torch.device) -> torch.Tensor:
        """(B, 1, 1, S) True for the slots each row has written, its new token's included."""
        return (self._slots[None, :] <= self.lengths[:, None])[:, None, None, :]

    def advance(self) -> None:
        """After a decoding forward: every row moves to its next slot (a finished row's is reset on refill)."""
        self.lengths.add_(1).clamp_(max=self.max_len - 1)

    def rows(self, bs: list[int]) -> KVCache:
        """A cache of rows `bs` writing their slots from 0, for prefilling prompts of one length
        together (batch len(bs)); sets their lengths after."""
        return _RowsCache(self, bs)


class _RowsCache(KVCache):
    """Rows bs of a StaticKVCache seen as a batch-len(bs) KVCache (prefill: slots 0..T-1, causal)."""

    def __init__(self, parent: StaticKVCache, bs: list[int]):
        super().__init__(len(bs), parent.max_len)
        self.parent = parent
        self.index = torch.tensor(bs, device=parent.lengths.device)  # (R,)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {end}")
        cache_k, cache_v = self.parent.buffers(layer, k)
        cache_k[self.index, :, start_pos:end] = k  # (R, Hkv, T, D) into slots start_pos..end-1
        cache_v[self.index, :, start_pos:end] = v
        self.parent.lengths[self.index] = end
        return cache_k[self.index, :, :end], cache_v[self.index, :, :end]
