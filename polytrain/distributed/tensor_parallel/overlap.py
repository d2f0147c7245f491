"""Overlap a region's backward reduction with its column layers' weight gradients (parallel.tp_overlap).

A tensor-parallel region's input gradient is the sum over tp of what each rank's column
layers (wq, wk, wv; the MLP's w1, w3) contribute: an all-reduce, or under SP a
reduce-scatter. Without overlap every column's backward computes its input and weight
gradients together and the region's entry reduces the summed input gradient after all of
them, while the cores wait. With it (Megatron's asynchronous input-gradient all-reduce,
here for a region of several column layers) the column layers compute the input gradient
only and leave their output gradients in the call's record; the entry starts the
reduction, computes every column's weight and bias gradients meanwhile, then waits:

    forward   x (B, T[/tp], D) -> Entry -> x_in (B, T, D), and W_i, b_i passed through
              x_in, W_i, b_i -> column i -> y_i (B, T, F_i/tp)
    backward  column i: dx_in += dy_i W_i; record dy_i
              Entry:    start reducing dx_in over tp
                        dW_i = dy_i^T x_in, db_i = sum dy_i      (while the reduction runs)
                        wait; dx (B, T[/tp], D)

The weights go through the entry so that their gradients, computed there, reach them
through autograd (gradient hooks of ZeRO and data parallelism fire as usual). The record
is per call, cleared by the entry's backward, so activation checkpointing's recomputation
and a retained graph's second backward count each gradient once. Used in eager training
only: a compiled block traces the plain collectives (its graph is the compiler's to
schedule), an autocast that casts (fp32 weights under train.autocast_only; 16-bit states run
under autocast to their own dtype, which casts nothing here) would need the casts this module
does not redo, and the zero-bubble pipeline schedule splits input and weight gradients itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from polytrain.distributed.collectives import all_gather, start_all_reduce, start_reduce_scatter
from polytrain.distributed.tensor_parallel.local_shard import local_shard

Product = Callable[..., torch.Tensor]
"""A column's `product` (x, weight, bias=None) -> x weight^T + bias: F.linear, or train.matmul_fp32's.
Every product of the deferred path goes through it, the backward's too (as F.linear of transposes)."""


@dataclass
class RegionCall:
    """One forward of a region in overlap mode: its entered inputs, routed parameters and gradient record.

    `params[i]` = (weight, bias or None) of column `columns[i]` as the entry passed them
    through; `records[i]` collects (output gradient, input index) of column i's uses. Only
    the records reach the autograd functions' contexts: the call holds their outputs, and a
    context holding the call would keep the whole graph alive in a reference cycle.
    """

    columns: list[torch.nn.Module]
    inputs: tuple[torch.Tensor, ...] = ()
    params: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    records: list[list[tuple[torch.Tensor, int]]] = field(default_factory=list)

    def linear(self, column: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """column(x) with its weight gradient deferred to the entry; None when `column` or `x` is not this call's."""
        slot = next((i for i, c in enumerate(self.columns) if c is column), None)
        source = next((i for i, e in enumerate(self.inputs) if e is x), None)
        if slot is None or source is None:
            return None
        w, b = self.params[slot]
        return _DeferredWeightGrad.apply(x, w, b, self.records[slot], source, column.product)


def _weight_grads(records: list[list[tuple[torch.Tensor, int]]], has_bias: list[bool], products: list[Product],
                  entered: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
    """Every routed weight's and bias's gradient from the records, in the entry's parameter order; clears them."""
    grads: list[torch.Tensor | None] = []
    for uses, bias, product in zip(records, has_bias, products):
        dw = db = None
        for dy, source in uses:
            dy2 = dy.reshape(-1, dy.shape[-1])  # (B*T, F/tp)
            x2 = entered[source].reshape(-1, entered[source].shape[-1])  # (B*T, D)
            part = product(dy2.t(), x2.t())  # dy2^T x2: (F/tp, D), the weight's (out, in) orientation
            dw = part if dw is None else dw + part
            if bias:
                db = dy2.sum(0) if db is None else db + dy2.sum(0)
        grads += [dw, db] if bias else [dw]
        uses.clear()
    return grads


def enter_overlapped(call: RegionCall, xs: tuple[torch.Tensor, ...], group: ProcessGroup,
                     seq_dim: int | None) -> tuple[torch.Tensor, ...]:
    """Enter the region with `xs`, routing the columns' parameters through the entry; fills `call`.

    `seq_dim`: under SP the dimension each x (B, T/tp, D) is all-gathered along (backward
    reduce-scatters); None: x is used as is (backward all-reduces).
    """
    has_bias = [c.bias is not None for c in call.columns]
    flat = []  # each column's local weight (out/tp, in), then its bias (out/tp,) if it has one
    for column, bias in zip(call.columns, has_bias):
        flat += [local_shard(column.weight), local_shard(column.bias)] if bias else [local_shard(column.weight)]
    call.records = [[] for _ in call.columns]
    products = [c.product for c in call.columns]
    out = _Entry.apply(call.records, has_bias, products, group, seq_dim, len(xs), *xs, *flat)
    call.inputs, passed = out[:len(xs)], iter(out[len(xs):])
    call.params = [(next(passed), next(passed) if bias else None) for bias in has_bias]
    return call.inputs


class _Entry(torch.autograd.Function):
    """Forward: inputs entered (as is, or all-gathered under SP), parameters passed through.
    Backward: start reducing the input gradients, compute the recorded weight gradients, wait."""

    @staticmethod
    def forward(ctx, records, has_bias, products, group, seq_dim, n_inputs, *tensors):
        ctx.records, ctx.has_bias, ctx.products = records, has_bias, products
        ctx.group, ctx.seq_dim, ctx.n_inputs = group, seq_dim, n_inputs
        ctx.set_materialize_grads(False)  # routed parameters get no gradient from their users: None, not zeros
        xs, params = tensors[:n_inputs], tensors[n_inputs:]
        entered = tuple(x.view_as(x) if seq_dim is None else all_gather(x, seq_dim, group) for x in xs)
        ctx.save_for_backward(*entered)  # what the deferred weight gradients multiply with
        return (*entered, *(p.view_as(p) for p in params))

    @staticmethod
    def backward(ctx, *grads):
        entered, n = ctx.saved_tensors, ctx.n_inputs
        started = []
        for g in grads[:n]:  # (B, T, D) per input: start all of them before any weight gradient
            if g is None:
                started.append((None, None))
            elif ctx.seq_dim is None:
                started.append(start_all_reduce(g, ctx.group))
            else:
                started.append(start_reduce_scatter(g, ctx.seq_dim, ctx.group))
        param_grads = _weight_grads(ctx.records, ctx.has_bias, ctx.products, entered)
        for i, passed in enumerate(grads[n:]):
            if passed is not None:  # a parameter also used outside the deferred path
                param_grads[i] = passed if param_grads[i] is None else param_grads[i] + passed
        input_grads = []
        for out, work in started:
            if work is not None:
                work.wait()
            input_grads.append(out)
        return (None, None, None, None, None, None, *input_grads, *param_grads)


class _DeferredWeightGrad(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx only and records dy for the entry (see module doc)."""

    @staticmethod
    def forward(ctx, x, w, b, record, source, product):
        ctx.record, ctx.source, ctx.product = record, source, product
        ctx.save_for_backward(w)
        return product(x, w, b)  # (B, T, out/tp)

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        ctx.record.append((dy, ctx.source))
        dx = ctx.product(dy, w.t()) if ctx.needs_input_grad[0] else None  # dy w: (B, T, out/tp) @ (out/tp, in)
        return dx, None, None, None, None, None

