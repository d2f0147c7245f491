"""The model facts the estimates need, read from a meta-device model: parameters per unit and per rank.

The model is built on the meta device (no memory, any size), so the counts are the
model's own, tied weights and all. Units are the top-level modules, with the blocks one
by one: for a decoder the units a pipeline cuts at (pipeline/plan.py: embedding units,
layers.0 .. layers.<n-1>, head units).

Under 1D tensor parallelism a rank holds 1/tp of every matrix (attention by heads, the
feed-forward by hidden features, embedding and head by vocabulary) and all of the
vectors (norm gains; biases are few enough to count whole). Key/value projections are
the exception when tp exceeds the KV heads: each rank then holds one whole KV head.
The 2D/2.5D grids split a matrix into q x q blocks (2.5D keeps tp_depth copies) and 3D
into q x q x q.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.config import Config
from polytrain.models import ARCHITECTURES
from polytrain.models.common.base import head_dim

KV_PROJECTIONS = ("attention.wk.weight", "attention.wv.weight")


@dataclass(frozen=True)
class UnitParams:
    """One unit's parameter elements: matrices (split by tp), vectors (replicated), KV projections."""

    matrices: int
    vectors: int
    kv: int = 0

    @property
    def total(self) -> int:
        return self.matrices + self.vectors + self.kv


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one configured model (see the module docstring); build with `model_shape(cfg)`."""

    units: dict[str, UnitParams]
    """Unit name -> its parameters; a tied output head counts under tok_embeddings only."""
    num_params: int
    flops_per_token: float
    """Training FLOPs per token (forward + backward), the model's own count."""
    largest_tensor: int
    """Elements of the largest parameter."""
    head_dim: int
    n_kv_heads: int

    def unit_params_per_rank(self, unit: str, tp: int, tp_mode: str = "1d", tp_depth: int = 1) -> float:
        """Elements of `unit` one tensor-parallel rank holds."""
        u = self.units[unit]
        if tp == 1:
            return u.total
        split = tp_split(tp, tp_mode, tp_depth)
        kv = u.kv / split
        if tp_mode == "1d" and tp > self.n_kv_heads:  # each rank holds one whole, shared KV head
            kv = u.kv / self.n_kv_heads
        return u.matrices / split + u.vectors + kv

    def block_params_per_rank(self, tp: int, tp_mode: str = "1d", tp_depth: int = 1) -> float:
        """Elements of one transformer block on one tensor-parallel rank."""
        return self.unit_params_per_rank("layers.0", tp, tp_mode, tp_depth)


def model_shape(cfg: Config) -> ModelShape:
    """Count the configured model's parameters by unit, on the meta device."""
    import torch

    m = cfg.model
    arch = ARCHITECTURES[m.arch]
    with torch.device("meta"):
        model = arch.build(m)
    units = {}
    names: list[str] = []
    for child, _ in model.named_children():  # in order: embeddings, the blocks, the head
        names += [f"layers.{key}" for key in model.layers] if child == "layers" else [child]
    for unit in names:
        matrices = vectors = kv = 0
        for name, p in model.get_submodule(unit).named_parameters():
            if unit == "output" and name == "weight" and m.tie_embeddings:
                continue  # the embedding's table, counted there
            if name.endswith(KV_PROJECTIONS):
                kv += p.numel()
            elif p.ndim >= 2:
                matrices += p.numel()
            else:
                vectors += p.numel()
        units[unit] = UnitParams(matrices, vectors, kv)
    return ModelShape(units=units, num_params=model.num_params(),
                      flops_per_token=model.flops_per_token(cfg.data.seq_len),
                      largest_tensor=max(p.numel() for p in model.parameters()),
                      head_dim=head_dim(m), n_kv_heads=m.n_kv_heads)


def tp_split(tp: int, tp_mode: str, tp_depth: int = 1) -> float:
    """How many ways a weight matrix is cut: tp in 1d and 2d, q^2 = tp / depth in 2.5d, tp in 3d."""
    if tp_mode == "2.5d":
        return tp / tp_depth
    return tp
