"""Applying a tensor-parallel plan: each role's implementation in each mode.

A model's plan is data (polytrain/models/common/plan.py's roles, one table per
architecture in polytrain/models/<arch>/plan.py). `parallelize_tp(model, plan, mesh, sp,
mode)` applies it from outside: the mode ("1d", Megatron's, in one_d.py; "2d" / "2.5d" in
summa.py; "3d" in three_d.py) supplies each role's implementation, which replaces the
matching module or rewires it in place, keeping every module and parameter name. A
pattern may match nothing: a pipeline stage may have no embedding, final norm or head.

The data flow the roles assume (batch-first activations; T/tp only under SP):

    tokens (B, T) -> VocabEmbedding -> (B, T[/tp], D)                 residual stream
      -> Norm -> Region enters: (B, T, D) on every rank -> Column ... -> (B, T, F/tp)
      -> Row leaves: (B, T[/tp], D) -> + residual ...
      -> Norm -> VocabHead (enters) -> logits (B, T, V/tp) -> vocabulary-parallel loss

A pipeline stage's input and output hidden states are the residual stream as this rank
holds it: (B, T/tp, D) under SP (this rank's tokens), (B, T, D) otherwise.

The grid modes keep every activation split over the grid (sequences by one set of grid
axes, features by another), so nothing leaves a region: in 2D/2.5D a Region gathers its
input along the grid row once for its Column layers, in 3D it is left alone, and Column
and Row are the same grid linear (3D: its two orientations); see summa.py, three_d.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain.distributed.rng import DropoutRNG
from polytrain.distributed.tensor_parallel import one_d, summa, three_d
from polytrain.distributed.tensor_parallel.context import TPContext
from polytrain.distributed.tensor_parallel.grid import Grid
from polytrain.distributed.tensor_parallel.lora import ColumnParallelLoRA, RowParallelLoRA
from polytrain.lora import LoRALinear
from polytrain.models.common.plan import Plan, Style

Context = TPContext | Grid
Implementation = Callable[[nn.Module, Style, Context], nn.Module]


@dataclass(frozen=True)
class Mode:
    """A tensor-parallel scheme: its layers' shared context and each role's implementation."""

    context: Callable[[DeviceMesh, bool, DropoutRNG | None], Context]
    roles: dict[str, Implementation]


def _grid(mode: str, layout) -> Callable[[DeviceMesh, bool, DropoutRNG | None], Grid]:
    def context(mesh: DeviceMesh, sp: bool, dropout: DropoutRNG | None) -> Grid:
        if sp:
            raise ValueError(f"sequence parallelism is 1d's; tp_mode {mode} already splits the sequences")
        return Grid(mesh, mode, layout.LOGITS_BATCH_AXES, layout.LOGITS_VOCAB_AXIS, dropout)
    return context


ONE_D: dict[str, Implementation] = {
    "root": lambda m, s, ctx: one_d.root(m, ctx, s.cache_argument, s.attention_inputs),
    "vocab_embedding": lambda m, s, ctx: one_d.VocabParallelEmbedding(m, ctx),
    "norm": lambda m, s, ctx: one_d.norm(m, ctx),
    "residual_table": lambda m, s, ctx: one_d.residual_table(m, ctx),
    "column_table": lambda m, s, ctx: one_d.column_table(m, ctx),
    "region": lambda m, s, ctx: one_d.region(m, ctx, s.sharded_methods, s.inputs),
    # A LoRALinear's adapters split with its base weight (lora.py).
    "column": lambda m, s, ctx: (ColumnParallelLoRA if isinstance(m, LoRALinear) else one_d.ColumnParallelLinear)(
        m, ctx, s.unit, s.shared_units),
    "row": lambda m, s, ctx: (RowParallelLoRA if isinstance(m, LoRALinear) else one_d.RowParallelLinear)(m, ctx),
    "vocab_head": lambda m, s, ctx: one_d.VocabParallelHead(m, ctx),
    "scalar_output": lambda m, s, ctx: one_d.scalar_output(m, ctx),
}

MODES: dict[str, Mode] = {
    "1d": Mode(TPContext, ONE_D),
    "2d": Mode(_grid("2d", summa), summa.ROLES),
    "2.5d": Mode(_grid("2.5d", summa), summa.ROLES),
    "3d": Mode(_grid("3d", three_d), three_d.ROLES),
}


def matches(pattern: str, name: str) -> bool:
    """True when module name `name` fits `pattern` ("*" = any one dot-separated component)."""
    if pattern == "" or name == "":
        return pattern == name
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have))


def parallelize_tp(model: nn.Module, plan: Plan, mesh: DeviceMesh, sp: bool, mode: str = "1d",
                   dropout: DropoutRNG | None = None, overlap: bool = False) -> Context:
    """Apply `plan` to `model` in place over the tp `mesh`; returns the layers' shared context.

    `mesh`: the 1-D tp mesh for "1d", the grid's sub-mesh (grid.grid_axes) otherwise.
    Run it on the meta device before activation checkpointing and data parallelism
    (materialize then fills each shard from its full, name-seeded value), or on a real
    model whose parameters are equal on every rank (each keeps its slice). `dropout`:
    the random streams for a model with dropout, None without. `overlap`: 1d regions reduce
    their input gradient while their columns' weight gradients are computed (overlap.py).
    """
    if mode not in MODES:
        raise ValueError(f"tensor-parallel mode {mode!r} has no implementation; available: {', '.join(MODES)}")
    modules = dict(model.named_modules())
    if mode != "1d" and any(isinstance(m, LoRALinear) for m in modules.values()):
        raise ValueError(f"LoRA adapters split with tp_mode 1d only, not {mode}")
    ctx = MODES[mode].context(mesh, sp, dropout)
    if isinstance(ctx, TPContext):
        ctx.overlap = overlap
    for pattern, style in plan.items():
        for name in [n for n in modules if matches(pattern, n)]:
            new = MODES[mode].roles[style.role](modules[name], style, ctx)
            if new is not modules[name]:
                if name == "":
                    raise ValueError("a plan's root style must modify the model in place")
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, new)
    # The memo of distributed parameters is keyed by id(); once the replaced modules are
    # gone their ids may be reused, so it must not outlive this pass.
    ctx.forget_parameters()
    return ctx
