"""Bytes one rank sends per attention layer under each context-parallel mode: the analytic
formulas (Jacobs et al. 2023 for Ulysses, Liu et al. 2023 for the ring) that the counted
traffic (collectives.comm_stats) is checked against.

B batch, T the whole sequence, H query and Hkv key/value heads of D channels on this rank
(after tensor parallelism), U Ulysses and R ring degree, P = U x R, e bytes per activation
element, g bytes per element of the ring's travelling K/V gradient (fp32: 4).

- Ulysses: 4 all-to-alls of this rank's T/P tokens each way, each sending (U-1)/U of it:
  (U-1)/U x B (T/P) D e (2H + 2H'), H' = Hkv, or U where Hkv < U (repeated key heads);
  the same in backward. For whole heads h = H D this is wave2's (2bsh + 2bs Hkv D)(P-1)/P^2.
- Ring: R - 1 hops of the K/V shard, 2 B H'' (T/R) D elements, H'' = Hkv / U (1 where the
  Ulysses step repeated heads); backward adds the gradient's R - 1 hops: x (e + g).
- Hybrid: both, the ring running on the heads the Ulysses step left.
"""

from __future__ import annotations


def attention_bytes(batch: int, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int,
                    ring: int, ulysses: int, elem_bytes: int, grad_bytes: int = 4) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends in one attention layer."""
    tokens = seq_len / (ring * ulysses)  # per rank
    forward = backward = 0.0
    kv_heads = n_kv_heads
    if ulysses > 1:
        sent = n_kv_heads if n_kv_heads % ulysses == 0 else ulysses
        per_pass = (ulysses - 1) / ulysses * batch * tokens * head_dim * elem_bytes * (2 * n_heads + 2 * sent)
        forward += per_pass
        backward += per_pass
        kv_heads = sent // ulysses
    if ring > 1:
        shard = 2 * batch * kv_heads * (seq_len / ring) * head_dim  # k and v of one ring rank
        forward += (ring - 1) * shard * elem_bytes
        backward += (ring - 1) * shard * (elem_bytes + grad_bytes)
    return forward, backward
