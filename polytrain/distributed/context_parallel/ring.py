"""Ring attention (Liu et al. 2023; Brandon et al.'s zigzag balancing): key/value shards
travel around the ring while each rank attends its own queries to them.

Forward, on R ring ranks, ring rank j at step s = 0..R-1 holds the keys and values of
ring rank src = j - s (its own at s = 0): it posts the send of that shard to j + 1 and
the receive of the next one from j - 1, computes its queries against the shard it has
(blockwise, skipping tiles the causal / document mask hides: under the zigzag layout that
is half of every foreign shard), then waits. The partial outputs are merged by their
log-sum-exp in fp32:

    lse = logaddexp(lse, lse_s);  out = out * exp(lse_old - lse) + out_s * exp(lse_s - lse)

Backward recomputes from q, k, v, the merged out and lse (nothing per step is kept): the
shards go around again, and the gradient of each shard's k and v travels with it, each
rank adding its part. Rank j's own shard is done first and its gradient kept; shard
j - s is added into the running gradient that arrives from j - 1 and sent on to j + 1,
which after R - 1 hops lands at the shard's owner. Bytes sent per rank: forward (R-1) x
the k and v shard; backward (R-1) x (the k and v shard + its fp32 gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from polytrain.distributed.collectives import exchange
from polytrain.distributed.context_parallel.layout import CPGroups
from polytrain.models.common.blockwise_attention import (
    Visibility,
    attention_backward,
    attention_forward,
)

@dataclass(frozen=True)
class RingPlan:
    """What one ring attention call needs besides q, k, v.

    slots[r] (t,): the global slots ring rank r's shard holds; documents (B, T): the whole
    batch's document ids, or None.
    """

    groups: CPGroups
    slots: list[torch.Tensor]
    documents: torch.Tensor | None
    causal: bool
    scale: float
    block: int

    def visibility(self, src: int) -> Visibility:
        """This ring rank's queries against ring rank src's keys."""
        mine, theirs = self.slots[self.groups.ring_rank], self.slots[src]
        docs = self.documents
        return Visibility(self.causal, mine, theirs,
                          None if docs is None else docs[:, mine], None if docs is None else docs[:, theirs])


class _Step:
    """One ring step's transfers, posted as one batch: each rotating tensor goes to the next
    ring rank while the previous ring rank's arrives.

    Every rank posts the same rotations in the same order, so each send is matched by the
    next rank's receive at the same place in its batch (tags play no part). Holding the key/value
    and the gradient rotation of a backward step in one batch keeps a ring of two ranks, whose
    next and previous rank are one peer, from posting a send and a receive with it apart.
    """

    def __init__(self, rotating: list[torch.Tensor], groups: CPGroups):
        self.incoming = [torch.empty_like(x) for x in rotating]
        nxt, prev = groups.ring_peer(1), groups.ring_peer(-1)
        self.batch = exchange(sends=[(x, nxt) for x in rotating], recvs=[(x, prev) for x in self.incoming],
                              group=groups.ring)

    def wait(self) -> list[torch.Tensor]:
        self.batch.wait()
        return self.incoming


def _merge(out: torch.Tensor, lse: torch.Tensor, out_s: torch.Tensor, lse_s: torch.Tensor) -> None:
    """Fold one shard's partial (out_s, lse_s) into the running (out, lse), in place."""
    new = torch.logaddexp(lse, lse_s)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows no shard has shown a key yet
    out.mul_(torch.exp(lse - safe)[..., None]).add_(out_s * torch.exp(lse_s - safe)[..., None])
    lse.copy_(new)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, t, D), k and v (B, Hkv, t, D) of this ring rank -> out (B, H, t, D), lse (B, H, t),
    in the compute dtype (fp32, fp64 for fp64 inputs), over every rank's keys."""
    R, j = plan.groups.ring_size, plan.groups.ring_rank
    kv = torch.stack([k, v])  # (2, B, Hkv, t, D): one message per step
    out, lse = None, None
    for step in range(R):
        rotation = _Step([kv], plan.groups) if step < R - 1 else None
        out_s, lse_s = attention_forward(q, kv[0], kv[1], plan.visibility((j - step) % R), plan.scale, plan.block)
        if out is None:
            out, lse = out_s, lse_s
        else:
            _merge(out, lse, out_s, lse_s)
        if rotation is not None:
            (kv,) = rotation.wait()
    return out, lse


def ring_backward(q, k, v, out, lse, dout, plan: RingPlan):
    """dq (B, H, t, D), dk and dv (B, Hkv, t, D) of ring_forward, in the compute dtype.

    Step s posts one batch before its compute: the key/value rotation (shard j - s out, j - s - 1
    in; not at the last step) and, from step 2, the gradient rotation (the running gradient of
    shard j - s + 1 out, that of shard j - s in from rank j - 1). A last batch after the loop
    brings this shard's gradient home.
    """
    R, j = plan.groups.ring_size, plan.groups.ring_rank
    kv = torch.stack([k, v])  # (2, B, Hkv, t, D)
    running = None  # (2, B, Hkv, t, D): the gradient of shard j - s + 1 so far, sent on at step s
    own = None  # (2, B, Hkv, t, D): this shard's gradient, completed last
    dq = None
    for step in range(R):
        rotating = ([kv] if step < R - 1 else []) + ([running] if running is not None else [])
        batch = _Step(rotating, plan.groups) if rotating else None
        dq_s, dk_s, dv_s = attention_backward(q, kv[0], kv[1], out, lse, dout,
                                              plan.visibility((j - step) % R), plan.scale, plan.block)
        dq = dq_s if dq is None else dq.add_(dq_s)
        partial = torch.stack([dk_s, dv_s])
        incoming = batch.wait() if batch is not None else []
        if step < R - 1:
            kv = incoming.pop(0)
        if running is not None:  # the gradient of shard j - step from the ranks before this one
            partial += incoming.pop(0)
        if step == 0:
            own = partial
        else:
            running = partial
    if running is not None:
        (arrived,) = _Step([running], plan.groups).wait()
        own += arrived  # this shard's gradient from every other rank
    return dq, own[0], own[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = ring_forward(q, k, v, plan)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, dout, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan) -> torch.Tensor:
    """Differentiable ring attention of this ring rank's q (B, H, t, D) over all ranks' k, v (B, Hkv, t, D)."""
    if not dist.is_initialized() and plan.groups.ring_size > 1:
        raise RuntimeError("ring attention over more than one rank needs torch.distributed initialised")
    return _RingAttention.apply(q, k, v, plan)
