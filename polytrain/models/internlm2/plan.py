"""How an InternLM2 (or a pipeline stage of one) is split for tensor and sequence parallelism.

Data only: polytrain.distributed applies it. Llama's plan, except that q, k and v come
from one packed `wqkv` (out rows = n_kv_heads groups of n_rep query heads, the key head
and the value head, head_dim rows each): it is a column split by whole KV groups, a unit
of (n_rep + 2) * head_dim rows, so each rank keeps its query heads with their key and
value and PackedAttention.project reads its local rows unchanged. A tp above n_kv_heads
would have to split a group's query heads apart from its key and value; the start-up
checks refuse it (Architecture.tp_shares_kv_heads = False).
"""

from __future__ import annotations

from polytrain.config import ModelConfig
from polytrain.models.common.base import head_dim
from polytrain.models.common.plan import Column, Plan, Region, Row
from polytrain.models.llama import plan as llama


def tp_plan(cfg: ModelConfig) -> Plan:
    """Module-name patterns of an InternLM2 -> their tensor-parallel roles."""
    group_rows = (cfg.n_heads // cfg.n_kv_heads + 2) * head_dim(cfg)  # one KV group's rows of wqkv
    plan = {k: v for k, v in llama.tp_plan(cfg).items() if not k.startswith("layers.*.attention.")}
    return {**plan,
            "layers.*.attention": Region(sharded_methods=("core",)),
            "layers.*.attention.wqkv": Column(unit=group_rows),
            "layers.*.attention.wo": Row()}
