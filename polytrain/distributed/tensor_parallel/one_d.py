"""1D (Megatron-LM) tensor parallelism: each plan role's implementation.

Weights are DTensors on the tp mesh, so Distributed Checkpoint reshards them to any
other layout; compute runs on their local shards with the explicit collectives of
TPContext (enter / leave a region), which DTensor would otherwise insert one op at a time.

    role             weight placement        input -> output (per rank)
    vocab_embedding  (V, D) Shard(0)         tokens (B, T) -> (B, T, D), or (B, T/tp, D) under SP
    norm             Replicate               (B, T, D) -> same; under SP (B, T/tp, D), gain grads summed over tp
    residual_table   (N, D) Replicate        ids (T,) or (B, T) -> (.., T, D); under SP this rank's (.., T/tp, D)
    column_table     (N, E) Shard(1)         ids -> (..., E/tp): a per-head table (T5's position bias)
    region           (none: wraps a module)  its input enters the region: copy, or all-gather under SP
    column           (out, in) Shard(0)      (B, T, in) -> (B, T, out/tp)
    row              (out, in) Shard(1)      (B, T, in/tp) -> (B, T, out) summed, or (B, T/tp, out) under SP
    vocab_head       (V, D), bias Shard(0)   (B, T, D) or (B, T/tp, D) -> logits (B, T, V/tp)
    root             (none: wraps the model) per-forward switches and the residual dropout stream

A vocabulary that tp does not divide is split unevenly (torch.chunk sizes, see
shard_range): no padding rows exist, so none can win in the loss or be sampled.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from polytrain.distributed.collectives import copy_to_tp, gather_from_tp
from polytrain.distributed.linear_cross_entropy import ScoringHead, chunk_tokens, linear_cross_entropy
from polytrain.distributed.tensor_parallel.context import SEQ_DIM, TPContext
from polytrain.distributed.tensor_parallel.local_shard import local_shard
from polytrain.distributed.tensor_parallel.overlap import RegionCall, enter_overlapped
from polytrain.distributed.tensor_parallel.shards import shard_range, shard_sizes


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output features split over tp; weight (out, in) and bias Shard(0).

    The input is already in the tensor-parallel region (the enclosing `region` entered
    it once for all of the module's column layers): (B, T, in), the same on every rank.
    Output (B, T, out/tp): this rank's features (its heads, its FFN columns).

    Shared units (grouped-query attention with tp > n_kv_heads): the weight is
    replicated and rank r computes unit r // (tp / units) only, e.g. KV head r // 2 of
    2 heads at tp = 4. Its gradient is the sum of what the ranks sharing each unit
    contribute, so the local weight enters through copy_to_tp (backward all-reduce).
    """

    product = staticmethod(F.linear)
    """How its product runs, (x, weight, bias=None) -> x weight^T + bias (LoRALinear.product's
    contract): train.matmul_fp32 sets an fp32-GEMM one on the instance."""

    def __init__(self, linear: nn.Linear, ctx: TPContext, unit: int = 1, shared_units: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.ctx = linear.in_features, linear.out_features, ctx
        units, n = self.out_features // unit, ctx.size
        if self.out_features % unit or (units % n and not (shared_units and n % units == 0)):
            raise ValueError(f"column-parallel linear: {units} units of {unit} output features cannot "
                             f"be split over tp = {n}")
        self.rows: slice | None = None  # rows of a replicated weight this rank uses (shared units)
        placement = Shard(0)
        if units % n:
            placement, owner = Replicate(), ctx.rank // (n // units)
            self.rows = slice(owner * unit, (owner + 1) * unit)
        self.weight = ctx.distribute(linear.weight, [placement])
        self.bias = ctx.distribute(linear.bias, [placement]) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = self.ctx.region_call
        deferred = call.linear(self, x) if call is not None else None  # weight gradient at the entry
        if deferred is not None:
            return deferred  # (B, T, out/tp)
        w = local_shard(self.weight)  # (out/tp, in), or (out, in) for shared units
        b = local_shard(self.bias) if self.bias is not None else None
        if self.rows is not None:
            w = copy_to_tp(w, self.ctx.group)[self.rows]  # (unit, in)
            b = copy_to_tp(b, self.ctx.group)[self.rows] if b is not None else None
        return self.product(x, w, b)  # (B, T, out/tp)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.ctx.size}"


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input features split over tp; weight (out, in) Shard(1), bias Replicate.

    Input (B, T, in/tp): a column layer's local output. Each rank's product is a partial
    sum of y; leaving the region sums it: all-reduce to (B, T, out), or under SP
    reduce-scatter to this rank's tokens (B, T/tp, out). The bias is added once, after.
    """

    product = staticmethod(F.linear)  # as ColumnParallelLinear.product

    def __init__(self, linear: nn.Linear, ctx: TPContext):
        super().__init__()
        self.in_features, self.out_features, self.ctx = linear.in_features, linear.out_features, ctx
        if self.in_features % ctx.size:
            raise ValueError(f"row-parallel linear: {self.in_features} input features cannot be split "
                             f"over tp = {ctx.size}")
        self.weight = ctx.distribute(linear.weight, [Shard(1)])
        self.bias = ctx.distribute(linear.bias, [Replicate()]) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.leave(self.partial(x))  # (B, T, out) or (B, T/tp, out)
        if self.bias is not None:
            y = y + self.ctx.residual_param(self.bias)
        return y

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (B, T, out) of y without the bias, before leaving the region."""
        return self.product(x, local_shard(self.weight))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.ctx.size}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp: weight (V, D) Shard(0).

    Each rank looks up the tokens in its row range and contributes zeros for the rest;
    summing over tp (leave) completes every row: (B, T, D), or (B, T/tp, D) under SP.
    """

    def __init__(self, embedding: nn.Embedding, ctx: TPContext):
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("vocabulary-parallel embedding supports neither padding_idx, max_norm nor sparse")
        self.num_embeddings, self.embedding_dim, self.ctx = embedding.num_embeddings, embedding.embedding_dim, ctx
        self.start, self.end = shard_range(self.num_embeddings, ctx.size, ctx.rank)
        self.weight = ctx.distribute(embedding.weight, [Shard(0)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        w = local_shard(self.weight)  # (V_local, D)
        local = tokens - self.start  # (B, T)
        inside = (local >= 0) & (local < w.shape[0])
        if w.shape[0] == 0:  # an empty shard (tiny vocabulary, large tp): contributes zeros
            partial = w.sum() * 0 + w.new_zeros(*tokens.shape, self.embedding_dim)
        else:
            partial = F.embedding(local.clamp(0, w.shape[0] - 1), w).masked_fill(~inside[..., None], 0.0)
        return self.ctx.leave(partial)  # (B, T, D) or (B, T/tp, D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.end}) of tp={self.ctx.size}"


class VocabParallelHead(ScoringHead, nn.Module):
    """Output projection with the vocabulary split over tp: weight (V, D) and bias (V,) Shard(0).

    Returns this rank's logits (B, T, V/tp): the full (B, T, V) never exists during
    training; the vocabulary-parallel cross-entropy works on the shards. While decoding
    (ctx.full_logits) it gathers them, since sampling needs every token's logit. A bias
    (BERT's per-token output bias) belongs to its vocabulary rows, so it is split with them.
    While scoring (the chunked loss) it returns the loss and no rank holds even its
    (B, T, V/tp) logits whole, only a chunk of tokens' at a time.
    """

    product = staticmethod(F.linear)  # the logits' (evaluation, decoding); the loss's: matmul_dtype

    def __init__(self, linear: nn.Linear, ctx: TPContext):
        super().__init__()
        self.in_features, self.out_features, self.ctx = linear.in_features, linear.out_features, ctx
        self.weight = ctx.distribute(linear.weight, [Shard(0)])  # the embedding's, when tied
        self.bias = ctx.distribute(linear.bias, [Shard(0)]) if linear.bias is not None else None
        self.vocab_start = shard_range(self.out_features, ctx.size, ctx.rank)[0]

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of hidden (B, T, D) or under SP (B, T/tp, D) against targets (B, T); equal on all tp ranks."""
        bias = local_shard(self.bias) if self.bias is not None else None
        hidden = self.ctx.enter(hidden)  # (B, T, D) on every rank
        # Every rank must run as many chunks (one all-gather each): sized by the largest shard.
        chunk = chunk_tokens(hidden.numel() // self.in_features, self.in_features,
                             max(shard_sizes(self.out_features, self.ctx.size)))
        return linear_cross_entropy(hidden, local_shard(self.weight), bias, targets, chunk,
                                    vocab_start=self.vocab_start, group=self.ctx.group,
                                    compile_backend=self.compile_backend, matmul_dtype=self.matmul_dtype,
                                    product=self.chunk_product)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scored = self.scored_forward(h)
        if scored is not None:
            return scored
        bias = local_shard(self.bias) if self.bias is not None else None
        logits = self.product(self.ctx.enter(h), local_shard(self.weight), bias)  # (B, T, V/tp)
        if self.ctx.full_logits:
            logits = gather_from_tp(logits, -1, shard_sizes(self.out_features, self.ctx.size), self.ctx.group)
        return logits

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, vocab={self.out_features}, tp={self.ctx.size}"


@contextlib.contextmanager
def _local_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Let `module`'s own forward see plain local tensors in place of its DTensor parameters."""
    saved = {name: module._parameters[name] for name in tensors}
    module._parameters.update(tensors)
    try:
        yield
    finally:
        module._parameters.update(saved)


def norm(module: nn.Module, ctx: TPContext) -> nn.Module:
    """Replicated-weight module on the residual stream (RMSNorm, LayerNorm): any class, in place."""
    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, ctx.distribute(param, [Replicate()]))
    inner = module.forward

    def forward(*args, **kwargs):
        local = {name: ctx.residual_param(p) for name, p in module.named_parameters(recurse=False)}
        with _local_parameters(module, local):
            return inner(*args, **kwargs)

    module.forward = forward
    return module


def scalar_output(module: nn.Module, ctx: TPContext) -> nn.Module:
    """A value model's replicated (1, D) head, in place: (B, T[/tp], D) -> values (B, T), whole on every rank.

    Without SP every rank computes the same values from the replicated stream. Under SP each
    rank scores its own tokens, (B, T/tp), and the values are gathered along the sequence
    (backward keeps each rank's slice); the weight's partial gradients are summed (Norm's rule).
    """
    module = norm(module, ctx)
    inner = module.forward

    def forward(h: torch.Tensor) -> torch.Tensor:
        values = inner(h)  # (B, T) or, under SP, (B, T/tp)
        if not ctx.sp_active:
            return values
        return gather_from_tp(values, 1, [values.shape[1]] * ctx.size, ctx.group)

    module.forward = forward
    return module


def residual_table(module: nn.Module, ctx: TPContext) -> nn.Module:
    """Replicated lookup table (nn.Embedding) whose rows join the residual stream per token, in place.

    Learned positions (T,) -> (T, D) and segment ids (B, T) -> (B, T, D) are added to the
    token embedding, which under SP is this rank's (B, T/tp, D): the table's output is cut
    to the same tokens along its sequence dimension (-2), and its gradient, then partial
    on each rank, is summed over tp (Norm's rule).
    """
    module = norm(module, ctx)
    inner = module.forward

    def forward(ids: torch.Tensor) -> torch.Tensor:
        rows = inner(ids)  # (..., T, D)
        if not ctx.sp_active:
            return rows
        ctx._check_divisible(rows.shape[-2])
        return rows.chunk(ctx.size, dim=-2)[ctx.rank]  # (..., T/tp, D): this rank's tokens

    module.forward = forward
    return module


def column_table(module: nn.Module, ctx: TPContext) -> nn.Module:
    """Lookup table (nn.Embedding) with its columns split over tp, in place: weight (N, E) Shard(1).

    T5's relative-position bias (buckets, heads): each rank looks up its own heads' biases,
    (T, S) -> (T, S, H/tp), the heads its attention computes. Its ids do not come from the
    residual stream and each rank's gradient is complete for its columns: no communication.
    """
    if module.weight.shape[1] % ctx.size:
        raise ValueError(f"column-split table: {module.weight.shape[1]} columns cannot be split over tp = {ctx.size}")
    module.weight = ctx.distribute(module.weight, [Shard(1)])
    inner = module.forward

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with _local_parameters(module, {"weight": local_shard(module.weight)}):
            return inner(ids)

    module.forward = forward
    return module


def region(module: nn.Module, ctx: TPContext, sharded_methods: tuple[str, ...] = (), inputs: int = 1) -> nn.Module:
    """The module's first `inputs` positional inputs enter the tensor-parallel region, once for
    all its column layers (cross-attention: the queries' states and the encoder's memory).

    `sharded_methods` compute on this rank's shard only (attention's `core` on its heads):
    their dropout draws from the per-rank stream.
    """
    inner = module.forward
    candidates: list[ColumnParallelLinear] | None = None  # found at the first forward: the plan replaces them after

    def forward(*args, **kwargs):
        nonlocal candidates
        if candidates is None:
            candidates = _overlappable_columns(module)
        # Trainable now (LoRA or RLHF may freeze a weight after the first forward).
        columns = [c for c in candidates if c.weight.requires_grad and (c.bias is None or c.bias.requires_grad)]
        if not (columns and ctx.overlap and ctx.region_call is None and args
                and _eager_training(args[:inputs], columns)):
            return inner(*(ctx.enter(a) for a in args[:inputs]), *args[inputs:], **kwargs)
        ctx.region_call = RegionCall(columns)
        try:
            entered = enter_overlapped(ctx.region_call, args[:inputs], ctx.group,
                                       SEQ_DIM if ctx.sp_active else None)
            return inner(*entered, *args[inputs:], **kwargs)
        finally:
            ctx.region_call = None

    module.forward = forward
    for name in sharded_methods:
        setattr(module, name, _under(getattr(module, name), lambda: ctx.sharded_rng(module.training)))
    return module


def _overlappable_columns(module: nn.Module) -> list[ColumnParallelLinear]:
    """The region's column layers whose weight gradient the overlapped entry can compute (see overlap.py).

    Not a LoRA column (its trainable adapters take the plain path; its base is frozen) nor
    shared units (their replicated weight is summed over tp through copy_to_tp).
    """
    return [m for m in module.modules() if type(m) is ColumnParallelLinear and m.rows is None]


def _eager_training(inputs: tuple, columns: list[ColumnParallelLinear]) -> bool:
    """A forward whose backward the overlapped entry can run: grad on, not compiling, and no autocast
    that casts here. 16-bit model states train under autocast to their own dtype, which leaves
    16-bit inputs and weights as they are; fp32 weights under autocast (autocast_only) would need
    the casts the entry does not redo."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    device = inputs[0].device.type
    if not torch.is_autocast_enabled(device):
        return True
    dtype = torch.get_autocast_dtype(device)
    return (all(x.dtype == dtype for x in inputs if isinstance(x, torch.Tensor))
            and all(c.weight.dtype == dtype for c in columns))


def root(module: nn.Module, ctx: TPContext, cache_argument: str = "cache",
         attention_inputs: str = "") -> nn.Module:
    """Per forward: decoding with a KV cache turns SP off and gathers full logits; dropout streams.

    `attention_inputs` (the Root role's): the model's method that builds RoPE tables and masks
    from a sequence length. On a pipeline stage without the embedding under SP the stage's
    input is this rank's (B, T/tp, D) slice while attention runs on all T tokens, so that
    method is asked for T/tp x tp positions.
    """
    inner = module.forward
    signature = inspect.signature(inner)

    def forward(*args, **kwargs):
        decoding = signature.bind(*args, **kwargs).arguments.get(cache_argument) is not None
        ctx.sp_active, ctx.full_logits = ctx.sp and not decoding, decoding
        try:
            with ctx.residual_rng(module.training):
                return inner(*args, **kwargs)
        finally:
            ctx.sp_active, ctx.full_logits = ctx.sp, False

    module.forward = forward
    if attention_inputs and ctx.sp and getattr(module, "tok_embeddings", None) is None:
        _inputs_for_whole_sequence(module, attention_inputs, ctx)
    return module


def _inputs_for_whole_sequence(module: nn.Module, method: str, ctx: TPContext) -> None:
    inner = getattr(module, method)

    def whole(seqlen: int, *args, **kwargs):
        return inner(seqlen * ctx.size if ctx.sp_active else seqlen, *args, **kwargs)

    setattr(module, method, whole)


def _under(fn: Callable, context: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)
    return wrapped
