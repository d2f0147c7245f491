"""Output projection and cross-entropy in token chunks, on one rank or vocabulary-parallel.

A model's last layer maps hidden states (N, D) to logits (N, V); the loss then needs
softmax(logits). Done plainly, autograd keeps the (N, V) logits, their log-softmax and,
in backward, their gradient: three N x V buffers, the largest activations of a small
model (2,048 tokens x 32K vocabulary = 256 MiB each in fp32). Here each chunk of C
tokens makes its (C, V) logits, turns them straight into the loss and the gradients of
the hidden states, weight and bias, and drops them; backward only scales the stored
gradients. Same FLOPs as the plain path (one forward and two gradient matmuls per
chunk); the loss's peak memory is one (C, V) chunk, about the size of the (N, D) hidden
states, instead of 3 x (N, V); on a CPU the chunks stay in cache.

Vocabulary-parallel (tensor parallelism: rank r holds vocabulary rows [start, end) of the
weight), each rank makes its chunk's (C, V/tp) logits and their log-sum-exp per token;
one all-gather of those (tp, C) values gives every rank the whole vocabulary's
log-sum-exp, so each rank's softmax rows, its gradient rows and its part of the hidden
states' gradient follow without more communication. The target logits, each on exactly
one rank, are summed by one scalar all-reduce at the end: every rank gets the same loss.
The hidden states' gradient is this rank's partial sum (its vocabulary rows); the
tensor-parallel region the head entered sums it over tp in backward.

Heads that offer this (`ScoringHead`) return the loss instead of logits while
`scoring(targets)` is active, or, `deferred` (a pipeline's last stage, whose schedule
applies the loss itself), return their input and score it through `loss(hidden, targets)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from polytrain.backend import host_cross_entropy
from polytrain.distributed.collectives import all_gather, all_reduce

IGNORE_INDEX = -100
FP16_BOUND = 2.0 ** 15
"""Largest magnitude allowed anywhere in an fp16 gradient matmul: half of fp16's largest finite 65504."""
MIN_CHUNK_TOKENS = 256
"""Fewest tokens per chunk: below this the matmuls get too thin to run at full speed."""


def fp16_grad_scale(h: torch.Tensor, weight_bound: torch.Tensor) -> torch.Tensor:
    """The largest power of two S <= FP16_BOUND for which one chunk's fp16 gradient matmuls cannot overflow.

    h (C, D) is the chunk's hidden states, weight_bound = 2 max|W| (this rank's rows). The rows
    of g = S (softmax - one_hot) have entries in [-S, S] and absolute sums at most 2 S, so
    |(g @ W)[c, d]| <= 2 S max|W| and |(g.T @ h)[v, d]| <= S sum_c |h[c, d]|, and so is every
    partial sum a matmul forms, in any order. A fixed scale overflows the weight gradient of
    a token that is the target of many rows of one chunk (an indentation run in code), at any
    loss scale, since the loss scale is applied after, in fp32. A 0-dim fp32 tensor: no host sync.
    """
    bound = torch.maximum(weight_bound, h.abs().sum(0, dtype=torch.float32).amax())
    return torch.exp2(torch.floor(torch.log2(FP16_BOUND / bound))).clamp_(max=FP16_BOUND)


def chunk_tokens(n_tokens: int, dim: int, vocab_size: int) -> int:
    """Tokens per chunk: a chunk's (C, V) logits hold about as many numbers as the (N, D) hidden
    states (the rule Liger-Kernel's fused loss uses), but at least MIN_CHUNK_TOKENS."""
    return max(MIN_CHUNK_TOKENS, -(-n_tokens * dim // vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """mean over scored tokens of CE(hidden @ weight.T + bias, targets), gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int, make_grads: bool, vocab_start: int, group,
                compile_backend: str | None, matmul_dtype: torch.dtype | None,
                product: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        # hidden (N, D), weight (V_local, D) = vocabulary rows [vocab_start, vocab_start + V_local)
        # (all of them without a group), bias (V_local,) or None, targets (N,) with IGNORE_INDEX holes.
        # Matmuls follow the surrounding autocast (as F.linear and autograd's own backward
        # matmuls would) unless matmul_dtype says otherwise; the softmax and the loss are fp32.
        # make_grads is False under no_grad (evaluation), where needs_input_grad still says True.
        # `product` (train.fp32_gemm: oneDNN) runs the logits' and the hidden states' gradient's
        # products as F.linear would; None: F.linear and @.
        want_h, want_w, want_b = (make_grads and need for need in ctx.needs_input_grad[:3])
        n_local = weight.shape[0]
        scored = targets != IGNORE_INDEX
        count = scored.sum().clamp(min=1).float()
        local_targets = targets - vocab_start
        mine = scored & (local_targets >= 0) & (local_targets < n_local)  # the target is one of my rows
        safe_targets = torch.where(mine, local_targets, 0)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        lse_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        target_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # The matmul dtype (matmul_dtype, autocast's or the weight's); the weight is cast once, not per chunk.
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)  # off when matmul_dtype is given
        low_dtype = matmul_dtype or (torch.get_autocast_dtype(device_type) if autocast else weight.dtype)
        weight_low = weight.to(low_dtype)
        bias_low = bias.to(low_dtype) if bias is not None else None
        # fp16's 5 exponent bits need a per-chunk scale (bf16 and fp32 have fp32's range).
        weight_bound = 2 * weight_low.abs().amax().float() if low_dtype == torch.float16 and n_local else None
        lse_of, grad_of = _kernels(compile_backend)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h, t, keep, hit = hidden[rows].to(low_dtype), safe_targets[rows, None], scored[rows], mine[rows]
            logits = (product or F.linear)(h, weight_low, bias_low)  # (C, V_local) in the matmul dtype
            lse, target = lse_of(logits, t, hit)  # (C,) -inf for an empty vocabulary shard; ()
            if group is not None:  # the whole vocabulary's, from every rank's (tp, C)
                lse = torch.logsumexp(all_gather(lse, 0, group).view(-1, lse.shape[0]), dim=0)
            lse_sum += (lse * keep).sum()
            target_sum += target
            if not (want_h or want_w or want_b):
                continue
            # fp16's gradient matmuls need a power-of-two scale S (see grad_of); each tp rank
            # picks its own: it only scales that rank's partial sums.
            scale = fp16_grad_scale(h, weight_bound) if weight_bound is not None else None
            grad, bias_sum = grad_of(logits, lse, t, hit, keep, scale, want_b)  # (C, V_local) low, (V_local,)
            if want_b:
                grad_b += bias_sum
            if want_h:
                dh = product(grad, weight_low.t()) if product is not None else grad @ weight_low  # (C, D)
                grad_h[rows] = dh.float().div_(count if scale is None else count * scale)
            if want_w and scale is None and grad.dtype == grad_w.dtype:  # fp32: summed inside the GEMM
                grad_w.addmm_(grad.t(), h)  # (V_local, D), no (V_local, D) product to add afterwards
            elif want_w:
                grad_w += (grad.t() @ h).float() if scale is None else (grad.t() @ h).float().div_(scale)
        for summed in (grad_w, grad_b):  # sums over tokens -> the gradients of the mean loss
            if summed is not None:
                summed.div_(count)
        if group is not None:  # each target's logit is on one rank
            target_sum = all_reduce(target_sum, group)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return (lse_sum - target_sum) / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.param_dtypes
        return (grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None,
                (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None,
                (grad_b * grad_loss).to(b_dtype) if grad_b is not None else None,
                None, None, None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk: int | None = None, *, vocab_start: int = 0,
                         group=None, compile_backend: str | None = None,
                         matmul_dtype: torch.dtype | None = None,
                         product: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T + bias` against `targets`, chunk tokens at a time.

    hidden (..., D), targets (...) with -100 = not scored; equals
    F.cross_entropy(F.linear(hidden, weight, bias).float(), targets) and its gradients.
    With a tensor-parallel `group`, `weight` and `bias` are this rank's vocabulary rows from
    `vocab_start`, the hidden states' gradient is this rank's part, and every rank must pass
    the same `chunk` (one all-gather per chunk). `compile_backend` (train.compile) runs each
    chunk's softmax and its gradient as two compiled kernels, each one pass over the chunk's logits.
    `matmul_dtype` (train.matmul_fp32: fp32) runs the chunks' products in that dtype instead of
    autocast's or the weight's. `product` (train.fp32_gemm), (x, weight, bias=None) -> x weight^T + bias,
    runs the chunks' logits and hidden-state gradients in place of F.linear.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    if chunk is None:
        chunk = chunk_tokens(hidden.shape[0], hidden.shape[1], weight.shape[0])
    # A surrounding autocast would round matmul_dtype's products to its own dtype.
    with torch.autocast(hidden.device.type, enabled=False) if matmul_dtype is not None else nullcontext():
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets.reshape(-1), chunk,
                                         torch.is_grad_enabled(), vocab_start, group, compile_backend, matmul_dtype,
                                         product)


def _chunk_lse(logits: torch.Tensor, t: torch.Tensor, hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's log-sum-exp per token and the sum of its target logits held here, in fp32.

    logits (C, V_local) in the matmul dtype; t (C, 1) local target rows (0 where not `hit`);
    hit (C,) whether the token's target is one of this rank's rows. Returns (C,), ()."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    if not logits.shape[1]:
        return lse, logits.new_zeros(())
    return lse, (logits.gather(1, t).squeeze(1) * hit).sum()


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, t: torch.Tensor, hit: torch.Tensor,
                keep: torch.Tensor, scale: torch.Tensor | None,
                want_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d(summed loss) / d logits = softmax - one_hot(target), 0 on unscored rows (`keep` false),
    in the matmul dtype for the gradient matmuls; and its column sums (the bias gradient) in fp32.

    Entries lie in [-1, 1]; in fp16 they are multiplied by the power of two `scale`, which
    lifts small probabilities (a 32K vocabulary's are ~3e-5) as far as the matmuls allow
    without overflow (exact to undo). lse (C,) is the whole vocabulary's log-sum-exp."""
    lse = torch.where(keep, lse, torch.inf)  # exp(logit - inf) = 0: unscored rows vanish
    grad = logits.float().sub_(lse[:, None]).exp_()  # (C, V_local) fp32; fp32 logits are reused in place
    if grad.shape[1]:
        grad.scatter_add_(1, t, hit[:, None].to(grad.dtype).neg_())
    bias_sum = grad.sum(0) if want_bias else None
    if scale is not None:
        grad.mul_(scale)
    return grad.to(logits.dtype), bias_sum


@functools.cache
def _kernels(compile_backend: str | None):
    """(lse_of, grad_of): a chunk's log-sum-exp and its softmax gradient.

    Compiled (train.compile) they are `_chunk_lse` and `_chunk_grad` through `compile_backend`,
    each one fused pass over the chunk: the full chunk's shape compiles first; a second one (a
    smaller last chunk, another batch's token count) makes dynamo compile one graph with a
    dynamic token dimension, so varying lengths (SFT, RLHF) do not recompile at every step.
    Eager, the host operators (backend/host_cross_entropy.py: one pass each, where torch's ops
    make a dozen) take fp32 and bf16 chunks on the host CPU without fp16's scale or a bias, and
    `_chunk_lse` / `_chunk_grad` the rest."""
    if compile_backend is not None:
        return (torch.compile(_chunk_lse, backend=compile_backend),
                torch.compile(_chunk_grad, backend=compile_backend))

    def lse_of(logits, t, hit):
        if host_cross_entropy.applies(logits):
            return host_cross_entropy.chunk_lse(logits, t, hit)
        return _chunk_lse(logits, t, hit)

    def grad_of(logits, lse, t, hit, keep, scale, want_bias):
        if scale is None and not want_bias and host_cross_entropy.applies(logits):
            return host_cross_entropy.chunk_grad(logits, lse, t, hit, keep), None
        return _chunk_grad(logits, lse, t, hit, keep, scale, want_bias)

    return lse_of, grad_of


class ScoringHead:
    """Mixin for output projections that can turn hidden states into the loss themselves.

    `scoring(targets)`: while active, forward returns the mean loss instead of logits.
    `deferred`: forward returns its input (the schedule scores it with `loss`).
    A subclass implements `loss(hidden, targets)` and calls `scored_forward` first in forward.
    """

    targets: torch.Tensor | None = None
    deferred: bool = False
    compile_backend: str | None = None
    """Set (train.compile): the loss's per-chunk kernels are compiled with this torch.compile backend."""
    matmul_dtype: torch.dtype | None = None
    """Set (train.matmul_fp32): the chunks' products run in this dtype, not the weight's or autocast's."""
    chunk_product: Callable[..., torch.Tensor] | None = None
    """Set (train.fp32_gemm): the chunks' logits and hidden-state gradients run through it, not F.linear."""

    @contextmanager
    def scoring(self, targets: torch.Tensor) -> Iterator[None]:
        """targets (B, T), -100 = not scored."""
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scored_forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """What forward returns when scoring or deferred; None = compute logits as usual."""
        if self.deferred:
            return hidden
        if self.targets is not None:
            return self.loss(hidden, self.targets)
        return None
