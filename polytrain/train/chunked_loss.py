"""Output projection and cross-entropy in token chunks, so the full logits never exist.

A model's last layer maps hidden states (N, D) to logits (N, V); the loss then needs
softmax(logits). Done plainly, autograd keeps the (N, V) logits, their log-softmax and,
in backward, their gradient: three N x V buffers, the largest activations of a small
model (2,048 tokens x 32K vocabulary = 256 MiB each in fp32). Here each chunk of C
tokens makes its (C, V) logits, turns them straight into the loss and the gradients of
the hidden states, weight and bias, and drops them; backward only scales the stored
gradients. Same FLOPs as the plain path (one forward and two gradient matmuls per
chunk); the loss's peak memory is one (C, V) chunk, about the size of the (N, D) hidden
states, instead of 3 x (N, V); on a CPU the chunks stay in cache.

The trainer swaps the model's `output` Linear for a `LossHead` (same parameters, same
state-dict keys) and asks it for the loss:

    with head.scoring(targets):     # targets (B, T), -100 = not scored
        loss = model(tokens)        # the head returns the mean loss, not (B, T, V) logits

Outside `scoring` the head is an ordinary Linear (evaluation of logits, generation).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100
FP16_BOUND = 2.0 ** 15
"""Largest magnitude allowed anywhere in an fp16 gradient matmul: half of fp16's largest finite 65504."""
MIN_CHUNK_TOKENS = 256
"""Fewest tokens per chunk: below this the matmuls get too thin to run at full speed."""


def fp16_grad_scale(h: torch.Tensor, weight_bound: torch.Tensor) -> torch.Tensor:
    """The largest power of two S <= FP16_BOUND for which one chunk's fp16 gradient matmuls cannot overflow.

    h (C, D) is the chunk's hidden states, weight_bound = 2 max|W|. The rows of
    g = S (softmax - one_hot) have entries in [-S, S] and absolute sums at most 2 S, so
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
                targets: torch.Tensor, chunk: int, make_grads: bool) -> torch.Tensor:
        # hidden (N, D), weight (V, D), bias (V,) or None, targets (N,) with IGNORE_INDEX holes.
        # Matmuls follow the surrounding autocast (as F.linear and autograd's own backward
        # matmuls would); the softmax and the loss are fp32.
        # make_grads is False under no_grad (evaluation), where needs_input_grad still says True.
        want_h, want_w, want_b = (make_grads and need for need in ctx.needs_input_grad[:3])
        scored = targets != IGNORE_INDEX
        count = scored.sum().clamp(min=1).float()
        safe_targets = torch.where(scored, targets, 0)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # The matmul dtype (autocast's or the weight's); the weight is cast once, not per chunk.
        device_type = hidden.device.type
        low_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        weight_low = weight.to(low_dtype)
        bias_low = bias.to(low_dtype) if bias is not None else None
        # fp16's 5 exponent bits need a per-chunk scale (bf16 and fp32 have fp32's range).
        weight_bound = 2 * weight_low.abs().amax().float() if low_dtype == torch.float16 else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h, t, keep = hidden[rows].to(low_dtype), safe_targets[rows, None], scored[rows]
            logits = F.linear(h, weight_low, bias_low).float()  # (C, V)
            lse = torch.logsumexp(logits, dim=-1)  # (C,)
            total += ((lse - logits.gather(1, t).squeeze(1)) * keep).sum()
            if not (want_h or want_w or want_b):
                continue
            # d(summed loss) / d logits = softmax - one_hot(target), 0 on unscored rows, in
            # [-1, 1]. In fp16, times a power of two S that lifts small probabilities (a 32K
            # vocabulary's are ~3e-5) as far as the matmuls allow without overflow; exact to undo.
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, t, torch.full_like(t, -1, dtype=grad.dtype))
            grad.mul_(keep[:, None])
            if want_b:
                grad_b += grad.sum(0)
            scale = None
            if weight_bound is not None:
                scale = fp16_grad_scale(h, weight_bound)
                grad.mul_(scale)
            grad = grad.to(low_dtype)  # the gradient matmuls run in the forward's dtype
            if want_h:
                grad_h[rows] = (grad @ weight_low).float().div_(count if scale is None else count * scale)
            if want_w:
                grad_w += (grad.t() @ h).float() if scale is None else (grad.t() @ h).float().div_(scale)
        for summed in (grad_w, grad_b):  # sums over tokens -> the gradients of the mean loss
            if summed is not None:
                summed.div_(count)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.param_dtypes
        return (grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None,
                (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None,
                (grad_b * grad_loss).to(b_dtype) if grad_b is not None else None,
                None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T + bias` against `targets`, chunk tokens at a time.

    hidden (..., D), targets (...) with -100 = not scored; equals
    F.cross_entropy(F.linear(hidden, weight, bias).float(), targets) and its gradients.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    chunk = chunk or chunk_tokens(hidden.shape[0], hidden.shape[1], weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets.reshape(-1), chunk,
                                     torch.is_grad_enabled())


class LossHead(nn.Linear):
    """A model's output projection that returns the loss while `scoring(targets)` is active."""

    targets: torch.Tensor | None = None

    @classmethod
    def replacing(cls, linear: nn.Linear) -> "LossHead":
        """A LossHead holding `linear`'s own parameters (tied ones stay tied)."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.in_features, head.out_features = linear.in_features, linear.out_features
        head.weight, head.bias = linear.weight, linear.bias
        return head

    @contextmanager
    def scoring(self, targets: torch.Tensor) -> Iterator[None]:
        self.targets = targets
        try:
            yield
        finally:
            self.targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, self.bias, self.targets)
