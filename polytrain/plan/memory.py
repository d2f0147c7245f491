"""Peak memory of one rank for a layout: model states, activations, the loss, buffers, as polytrain holds them.

Model states (P = this rank's parameters after tensor and pipeline splitting, N = dp;
weights and gradients are fp32 in every precision today, bf16/fp16 autocast the matmuls;
Adam keeps 8 bytes a parameter, SGD/LARS momentum 4):

    zero 0   4P weights + 4P gradients + 8P Adam                 (replicas, FSDP2)
    zero 1   4P weights + 4P gradients + (4 + 8)P/N masters and Adam + 4P/N gradient shard
    zero 2   4P weights + 4P/N gradient shard + (4 + 8)P/N; full gradients bucket by bucket
    zero 3   (4 + 4 + 8)P/N, plus the units FSDP2 has gathered: the root (embeddings, final
             norm, head) for the whole step, the last block, the block in use and the
             prefetched one (a pipeline stage keeps all of its blocks gathered)

Activations: activations.py per block and token, times the micro-batches a pipeline
rank holds at once (1F1B: pp - rank; GPipe: all; interleaved: Megatron's factor
1 + (pp - 1) / (pp v); ZB-V: pp), each with its stage output (the schedule keeps it for
the backward: hidden states, or the last stage's logits), plus the loss: three
(tokens x vocab/tp) fp32 buffers and the 16-bit logits for the plain loss, one chunk of
them for the chunked loss (which makes the head's gradient and the hidden states'
gradient during forward; under tp its vocabulary rows, and on a pipeline's last stage per
micro-batch in flight).

The peak is the larger of two moments: the end of a micro-batch's forward (all its
activations, the loss, gradients kept from earlier micro-batches) and the optimizer
step (gradients whole, plus the update's temporaries: none for the fused AdamW, one
parameter-sized buffer for LAMB/LARS, which make every update before any trust ratio).
On top comes the device's `context_bytes` (runtime, communicators, allocator slack).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from polytrain.config import Config
from polytrain.distributed.pipeline.plan import PipelinePlan, plan_pipeline
from polytrain.models import ARCHITECTURES
from polytrain.plan.activations import (
    FP32,
    BlockDims,
    autocast_weight_bytes,
    block_bytes_per_token,
    block_family,
    head_bytes_per_token,
)
from polytrain.plan.devices import Cluster
from polytrain.plan.layouts import Layout
from polytrain.plan.shapes import ModelShape, tp_split

OPTIMIZER_STATE_BYTES = {"adamw": 8, "lamb": 8, "lars": 4, "sgd": 4}
ALL_AT_ONCE_UPDATES = ("lamb", "lars")  # trust ratios need every update before applying any
CHUNKED_LOSS_MIN_TOKENS = 256


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the fullest rank at its peak, by part; `phase` says which moment that is."""

    parts: dict[str, float]
    phase: str
    pipeline_rank: int = 0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    """Both moments' parts (the runtime context aside): 'forward/backward' and 'optimizer step'."""
    host_bytes_per_node: float = 0.0
    """Offloaded state on the host (parallel.offload = cpu), per node."""
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def compute_bytes(precision: str) -> int:
    """Bytes of an activation element: fp32 training keeps 4, autocast's matmuls produce 2."""
    return FP32 if precision == "fp32" else 2


def pipeline_plan(cfg: Config, shape: ModelShape, layout: Layout) -> PipelinePlan | None:
    """Which units each pipeline rank holds (pipeline/plan.py's balanced split), or None without pp."""
    if layout.pp == 1:
        return None
    arch = ARCHITECTURES[cfg.model.arch]
    return _plan_pipeline(layout.pp, layout.pp_schedule, layout.pp_virtual_stages, cfg.model.n_layers,
                          layout.accum, arch.embedding_units, arch.head_units)


@functools.lru_cache(maxsize=4096)
def _plan_pipeline(pp, schedule, virtual, n_layers, accum, embedding, head) -> PipelinePlan:
    return plan_pipeline(pp, schedule, virtual, "", n_layers, 0, accum, embedding, head)


def rank_units(cfg: Config, shape: ModelShape, plan: PipelinePlan | None, pp_rank: int) -> list[str]:
    """The units pipeline rank `pp_rank` holds (all of them without pp)."""
    if plan is None:
        return list(shape.units)
    return [u for s in plan.stages_of_rank(pp_rank) for u in plan.stages[s]]


def in_flight(layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak."""
    m = layout.accum  # one pipeline run per step: all of the rank's micro-batches
    pp = layout.pp
    if pp == 1:
        return 1
    if layout.pp_schedule == "gpipe":
        return m
    if layout.pp_schedule == "interleaved":
        v = layout.pp_virtual_stages
        return min(m, (pp - pp_rank) * (1 + (pp - 1) / (pp * v)))
    if layout.pp_schedule == "zero_bubble":
        return min(m, pp)
    return min(m, pp - pp_rank)


def estimate_memory(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster) -> MemoryEstimate:
    """The peak of the fullest rank (over pipeline ranks) for `layout` (see the module docstring)."""
    plan = pipeline_plan(cfg, shape, layout)
    best = None
    # The first pipeline rank holds the most micro-batches (and the embedding, and the extra
    # blocks of an uneven split), the last the head and the loss: one of them is the fullest.
    for pp_rank in sorted({0, layout.pp - 1}):
        estimate = _rank_memory(cfg, shape, layout, cluster, plan, pp_rank)
        if best is None or estimate.total > best.total:
            best = estimate
    return best


@dataclass(frozen=True)
class _Rank:
    """One pipeline rank's share of the model: its parameter elements (tp- and pp-local)."""

    params: float
    block: float
    root: float
    """Embeddings, final norm and head."""
    blocks: int
    first: bool
    last: bool


def _rank_share(cfg: Config, shape: ModelShape, layout: Layout, plan: PipelinePlan | None, pp_rank: int) -> _Rank:
    m = cfg.model
    units = rank_units(cfg, shape, plan, pp_rank)
    first, last = units[0] == ARCHITECTURES[m.arch].embedding_units[0], "output" in units
    local = {u: shape.unit_params_per_rank(u, layout.tp, layout.tp_mode, layout.tp_depth) for u in units}
    if last and m.tie_embeddings and layout.pp > 1 and not first:  # the head's copy of the table
        local["output"] = shape.units["tok_embeddings"].matrices / tp_split(layout.tp, layout.tp_mode, layout.tp_depth)
    blocks = [u for u in units if u.startswith("layers.")]
    params = sum(local.values())
    return _Rank(params, shape.block_params_per_rank(layout.tp, layout.tp_mode, layout.tp_depth),
                 params - sum(local[u] for u in blocks), len(blocks), first, last)


def _model_states(cfg: Config, layout: Layout, rank: _Rank, cluster: Cluster):
    """(resident parts, gradients kept between micro-batches, gradients at the step, host bytes per node)."""
    t, n, zero, params = cfg.train, layout.dp, layout.zero, rank.params
    opt = OPTIMIZER_STATE_BYTES[t.optimizer] if t.optimizer != "sgd" or t.momentum else 0
    parts: dict[str, float] = {}
    shard = n if zero in (1, 2, 3) else 1
    if zero == 3:
        parts["weights (shards)"] = FP32 * params / n
        parts["gathered weights"] = FP32 * (params if layout.pp > 1 else rank.root + min(rank.blocks, 3) * rank.block)
    else:
        parts["weights"] = FP32 * params
        if zero == 0 and n > 1:  # FSDP2 gathers replicas into buffers of their own, kept for the step
            parts["gathered weights"] = FP32 * params
    whole, piece = FP32 * params, FP32 * params / n
    if zero in (1, 2):
        parts["master weights"] = piece
    state = opt * params / shard
    # Gradients kept while later micro-batches run, and held at the optimizer step: whole for
    # replicas; ZeRO-1 whole until its buckets reduce (the shard at the step); ZeRO-2/3 the shard.
    kept = {0: whole, 1: whole, 2: piece, 3: piece}[zero] if layout.accum > 1 or zero == 2 else 0.0
    final = whole if zero == 0 else piece
    host = 0.0
    if layout.offload != "none":  # masters, optimizer state and gradient shards leave the device
        host = (parts.pop("master weights") + state + piece) * cluster.per_node
        kept, final = (kept, whole) if zero == 1 else (0.0, 0.0)
    else:
        parts["optimizer state"] = state
    return parts, kept, final, host


def _rank_memory(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster,
                 plan: PipelinePlan | None, pp_rank: int) -> MemoryEstimate:
    m, t = cfg.model, cfg.train
    rank = _rank_share(cfg, shape, layout, plan, pp_rank)
    tp, split = layout.tp, tp_split(layout.tp, layout.tp_mode, layout.tp_depth)
    parts, grads_kept, grads_final, host = _model_states(cfg, layout, rank, cluster)

    # ----- activations of the micro-batches in flight, and the loss -----
    cb = compute_bytes(t.precision)
    family = block_family(m.arch)
    dims = BlockDims(m.dim, m.ffn_dim, m.n_heads, shape.head_dim, m.n_kv_heads)
    tokens = layout.micro_batch_size * cfg.data.seq_len / layout.cp
    grid = layout.tp_mode != "1d" and tp > 1
    act_tp, act_sp = (1, False) if grid else (tp, layout.sp)
    per_token = rank.blocks * block_bytes_per_token(family, dims, cb, act_tp, act_sp, layout.activation_checkpoint)
    if rank.last:
        per_token += head_bytes_per_token(family, m.dim, cb, act_tp, act_sp)
    if grid:  # the grids split every activation tp ways (sequences and features)
        per_token /= tp
    block_matrices = rank.block - shape.units["layers.0"].vectors
    copies = autocast_weight_bytes(block_matrices, cb, layout.activation_checkpoint) * rank.blocks
    flight = in_flight(layout, pp_rank)
    activations = flight * (tokens * per_token + copies)
    if layout.pp > 1:  # the schedule keeps each in-flight micro-batch's stage output for its backward
        # (the last stage's: its logits, or with the chunked loss its hidden states, which it scores)
        logits = rank.last and not _chunked(cfg, layout)
        width = m.vocab_size / tp * cb if logits else m.dim * FP32 / (tp if layout.sp and not rank.last else 1)
        activations += flight * tokens * width
    if layout.activation_checkpoint == "full" and rank.blocks:  # one block recomputed in backward
        activations += tokens * block_bytes_per_token(family, dims, cb, act_tp, act_sp) / (tp if grid else 1)
        activations += autocast_weight_bytes(block_matrices, cb, "none")
    loss = _loss_bytes(cfg, layout, tokens, cb, flight) if rank.last else 0.0
    head_grad = 0.0
    if rank.last and _chunked(cfg, layout):
        # Made in forward, kept per micro-batch in flight: the head's (vocabulary rows') gradient
        # and the hidden states'.
        head_grad = flight * FP32 * (m.vocab_size / tp * m.dim + tokens * m.dim)

    # ----- the two moments -----
    forward = {**parts, "gradients": grads_kept + head_grad, "activations": activations, "loss": loss}
    if layout.zero == 3:
        # Early in backward, a block's unsharded gradients and the next one's, before reduce-scatter.
        forward["gradients (gathering)"] = FP32 * 2 * rank.block
    elif layout.zero in (1, 2):  # backward's first bucket is packed for its reduce-scatter while activations live
        forward["gradient bucket"] = min(cfg.parallel.reduce_bucket_mb * 2**20, FP32 * rank.params)
    shard = layout.dp if layout.zero else 1
    step_temp = _update_temporaries(t.optimizer, rank.params / shard, shape.largest_tensor / split / shard,
                                    cluster, layout)
    step = {**parts, "gradients": grads_final, "update temporaries": step_temp}
    if "gathered weights" in step:
        step["gathered weights"] = 0.0  # resharded by the time the optimizer runs
    if layout.zero in (1, 2):  # the updated masters are all-gathered into the weights bucket by bucket
        step["gather buckets"] = 2 * cfg.parallel.reduce_bucket_mb * 2**20
    phases = {"forward/backward": forward, "optimizer step": step}
    phase = max(phases, key=lambda name: sum(phases[name].values()))
    out = {k: v for k, v in phases[phase].items() if v}
    out["runtime context"] = cluster.device.context_bytes
    return MemoryEstimate(out, phase, pp_rank, phases=phases, host_bytes_per_node=host)


def chunk_tokens(tokens: float, dim: int, vocab_size: int) -> float:
    """Tokens per chunk of the chunked loss: logits about the size of the hidden states, at least 256
    (distributed/linear_cross_entropy.py's rule; tests/unit/test_plan.py holds the two equal)."""
    return max(CHUNKED_LOSS_MIN_TOKENS, -(-tokens * dim // vocab_size))


def _update_temporaries(optimizer: str, opt_params: float, largest: float, cluster: Cluster,
                        layout: Layout) -> float:
    """Buffers the optimizer step allocates (optim/builder.py's choice of implementation):

    AdamW runs torch's fused kernel, in place, except over meshes of more than two axes (a
    tp grid x dp), where it loops per tensor; LAMB/LARS make every tensor's update before any
    trust ratio (one parameter-sized buffer); SGD's foreach weight decay over DTensors makes
    one too. A per-tensor loop needs a few of the largest tensor's size."""
    grid = layout.tp_mode if layout.tp > 1 else "1d"
    multi_tensor = grid == "1d" or (grid == "2d" and layout.dp == 1)  # meshes of at most two axes
    if optimizer in ALL_AT_ONCE_UPDATES:
        return FP32 * opt_params
    if optimizer == "adamw" and multi_tensor:
        return 0.0
    dtensors = layout.zero in (0, 3) and (layout.dp > 1 or layout.tp > 1)
    if optimizer == "sgd" and dtensors and multi_tensor:
        return FP32 * opt_params
    return 2 * FP32 * largest


def _chunked(cfg: Config, layout: Layout) -> bool:
    """Whether the trainer swaps in the chunked loss head (train.chunked_loss; not on a 2d/2.5d/3d grid)."""
    return cfg.train.chunked_loss and (layout.tp == 1 or layout.tp_mode == "1d")


def _loss_bytes(cfg: Config, layout: Layout, tokens: float, cb: int, flight: float) -> float:
    """The loss's peak: a chunk of logits for the chunked loss, else (tokens x vocab/tp) buffers."""
    m = cfg.model
    if _chunked(cfg, layout):  # this rank's vocabulary rows under tp
        vocab = m.vocab_size / layout.tp
        chunk = min(tokens, chunk_tokens(tokens, m.dim, vocab))
        low = vocab * m.dim * cb if cb < FP32 else 0.0  # the weight cast once per call
        return chunk * vocab * (2 * FP32 + cb) + low
    vocab = m.vocab_size / layout.tp
    saved = tokens * vocab * FP32  # log-softmax output, kept per micro-batch in flight
    # the logits in the head's dtype, an fp32 copy of them (autocast), and backward's two gradients
    working = tokens * vocab * (cb + (FP32 if cb < FP32 else 0) + 2 * FP32)
    return max(flight, 1) * saved + working
