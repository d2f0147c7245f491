"""Tensor-parallel plans as data: module-name patterns -> the role each module plays.

A model's plan (polytrain/models/<arch>/plan.py) names roles, not layer classes, the way a
Hugging Face config carries its `tp_plan`: plain data about the model, which
polytrain.distributed reads and applies from outside (tensor_parallel/plan.py):

    {"": Root(),
     "tok_embeddings": VocabEmbedding(),
     "layers.*.attention_norm": Norm(),
     "layers.*.attention": Region(sharded_methods=("core",)),
     "layers.*.attention.wq": Column(unit=head_dim),
     "layers.*.attention.wo": Row(), ...
     "output": VocabHead()}

Patterns are dot-separated names where "*" matches one component and "" is the model
itself. A pattern may match nothing: a pipeline stage holds only some layers.
Also here: the roles of the shared layers (models/common), which every plan splits alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Style:
    role: ClassVar[str]


@dataclass(frozen=True)
class Root(Style):
    """The model (or stage) itself: per-forward switches; `cache_argument` names the KV cache.

    `attention_inputs`: the model's method that builds per-forward attention inputs (RoPE
    tables, masks) from the sequence length, when it has one. A pipeline stage without the
    embedding receives this rank's sequence shard under SP while its attention runs on the
    whole sequence, so the layout asks that method for the whole length.
    """

    role: ClassVar[str] = "root"
    cache_argument: str = "cache"
    attention_inputs: str = ""


@dataclass(frozen=True)
class VocabEmbedding(Style):
    """Token embedding, rows split by vocabulary."""

    role: ClassVar[str] = "vocab_embedding"


@dataclass(frozen=True)
class Norm(Style):
    """Replicated weights on the residual stream; runs on sequence shards under SP."""

    role: ClassVar[str] = "norm"


@dataclass(frozen=True)
class ResidualTable(Style):
    """Replicated lookup table added to the residual stream per token (learned positions,
    segments); under SP each rank keeps its own tokens' rows."""

    role: ClassVar[str] = "residual_table"


@dataclass(frozen=True)
class ColumnTable(Style):
    """Lookup table with its columns split (a per-head bias table, split like the heads)."""

    role: ClassVar[str] = "column_table"


@dataclass(frozen=True)
class Region(Style):
    """A module whose input enters the tensor-parallel region (attention, MLP).

    `sharded_methods`: its methods that compute on this rank's shard only (e.g. the
    attention core on local heads), whose dropout must differ across ranks. `inputs`:
    how many leading positional arguments enter (2 for cross-attention's memory).
    """

    role: ClassVar[str] = "region"
    sharded_methods: tuple[str, ...] = ()
    inputs: int = 1


@dataclass(frozen=True)
class Column(Style):
    """Linear layer with its output features split.

    `unit`: features that must stay together (a head's head_dim). `shared_units`: when
    tp exceeds the number of units, each unit is replicated on tp / units consecutive
    ranks (KV heads of grouped-query attention).
    """

    role: ClassVar[str] = "column"
    unit: int = 1
    shared_units: bool = False


@dataclass(frozen=True)
class Row(Style):
    """Linear layer with its input features split; its output leaves the region."""

    role: ClassVar[str] = "row"


@dataclass(frozen=True)
class VocabHead(Style):
    """Output projection, rows (and bias) split by vocabulary; logits stay split for the loss."""

    role: ClassVar[str] = "vocab_head"


@dataclass(frozen=True)
class ScalarOutput(Style):
    """A small replicated output projection (a value model's (1, D) head): one value per token,
    whole on every rank (gathered along the sequence under SP)."""

    role: ClassVar[str] = "scalar_output"


Plan = dict[str, Style]


def attention_roles(path: str, head_dim: int, shared_kv: bool = False, inputs: int = 1) -> Plan:
    """Roles of a common Attention at module pattern `path`, split by heads.

    wq/wk/wv are columns of whole heads (`head_dim` rows each), wo a row; the core
    (softmax(q k^T) v on this rank's heads) draws per-rank dropout. `shared_kv`: tp may
    exceed the KV heads, each then replicated on tp / n_kv_heads ranks. `inputs`: 2 for
    cross-attention, whose memory (the encoder's output) enters the region too.
    """
    return {path: Region(sharded_methods=("core",), inputs=inputs),
            f"{path}.wq": Column(unit=head_dim),
            f"{path}.wk": Column(unit=head_dim, shared_units=shared_kv),
            f"{path}.wv": Column(unit=head_dim, shared_units=shared_kv),
            f"{path}.wo": Row()}


def feed_forward_roles(path: str) -> Plan:
    """Roles of a common FeedForward at `path`: w1 (and w3 when gated) columns, w2 a row."""
    return {path: Region(), f"{path}.w1": Column(), f"{path}.w3": Column(), f"{path}.w2": Row()}
