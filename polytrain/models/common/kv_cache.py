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
