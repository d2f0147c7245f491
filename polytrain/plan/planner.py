"""Rank the layouts of a cluster: every accepted layout, its peak memory per rank and its step time.

    estimates = plan(cfg, Cluster(device_spec("H100"), devices=64, nodes=8))
    best = estimates[0]            # fits, fastest step
    best.layout.config_keys()      # {"parallel.tp": 8, "parallel.pp": 2, ...}

Layouts that fit (peak below the device's memory less `headroom`) come first, fastest
step first (ties: less memory); those that do not fit follow, smallest first. The
user's own choices are kept: any layout key the config sets away from its default
(e.g. parallel.tp = 2, train.activation_checkpoint = full) fixes that key.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.config import Config, ParallelConfig, TrainConfig
from polytrain.plan.devices import GiB, Cluster
from polytrain.plan.layouts import Layout, SearchSpace, candidate_layouts, has_cp_keys
from polytrain.plan.memory import MemoryEstimate, estimate_memory
from polytrain.plan.shapes import ModelShape, model_shape
from polytrain.plan.step_time import TimeEstimate, estimate_step_time

# Layout field -> (config section class, key), for the keys a user may fix.
FIXABLE = {"dp": (ParallelConfig, "dp"), "zero": (ParallelConfig, "zero"), "tp": (ParallelConfig, "tp"),
           "tp_mode": (ParallelConfig, "tp_mode"), "sp": (ParallelConfig, "sp"), "pp": (ParallelConfig, "pp"),
           "pp_schedule": (ParallelConfig, "pp_schedule"), "offload": (ParallelConfig, "offload"),
           "micro_batch_size": (TrainConfig, "micro_batch_size"),
           "activation_checkpoint": (TrainConfig, "activation_checkpoint"),
           "cp": (ParallelConfig, "cp"), "cp_mode": (ParallelConfig, "cp_mode")}


@dataclass(frozen=True)
class Estimate:
    """One layout with its estimates."""

    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool
    tokens_per_s: float
    mfu: float

    @property
    def memory_gb(self) -> float:
        return self.memory.total / GiB

    def as_json(self) -> dict:
        """The layout's config keys, `memory_gb` per rank, `step_time_s`, and the parts of both."""
        return {**self.layout.config_keys(), "memory_gb": round(self.memory_gb, 3),
                "step_time_s": round(self.time.total, 6), "fits": self.fits,
                "tokens_per_s": round(self.tokens_per_s, 1), "mfu": round(self.mfu, 4),
                "layout": self.layout.describe(), "peak_phase": self.memory.phase,
                "memory_parts_gb": {k: round(v / GiB, 3) for k, v in self.memory.parts.items()},
                "time_parts_s": {k: round(v, 6) for k, v in self.time.parts.items()},
                "comm_bytes_per_rank": {k: round(v) for k, v in self.time.comm_bytes.items()},
                "host_gb_per_node": round(self.memory.host_bytes_per_node / GiB, 3)}


def fixed_choices(cfg: Config) -> dict[str, object]:
    """Layout fields the config sets away from their defaults: the user's choices, kept."""
    out = {}
    defaults = {ParallelConfig: ParallelConfig(), TrainConfig: TrainConfig()}
    for name, (section_cls, key) in FIXABLE.items():
        section = cfg.parallel if section_cls is ParallelConfig else cfg.train
        if hasattr(section, key) and getattr(section, key) != getattr(defaults[section_cls], key):
            out[name] = getattr(section, key)
    return out


def evaluate(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster, headroom: float = 0.05) -> Estimate:
    """Memory and time of one layout."""
    memory = estimate_memory(cfg, shape, layout, cluster)
    time = estimate_step_time(cfg, shape, layout, cluster)
    device = cluster.device
    host_ok = memory.host_bytes_per_node <= device.host_memory_bytes * (1 - headroom)
    fits = memory.total <= device.memory_bytes * (1 - headroom) and host_ok
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / time.total
    peak = device.flops(cfg.train.precision) * cluster.rank_share() * cluster.devices
    return Estimate(layout, memory, time, fits, tokens, tokens * shape.flops_per_token / peak)


def plan(cfg: Config, cluster: Cluster, space: SearchSpace | None = None, headroom: float = 0.05,
         allow_cp: bool = False) -> list[Estimate]:
    """Every accepted layout of `cluster` for `cfg`, ranked (see the module docstring)."""
    if space is None:
        space = SearchSpace(max_cp=cluster.devices if (allow_cp or has_cp_keys(cfg)) else 1,
                            offload=("none", "cpu") if not cluster.device.cores_per_node else ("none",))
    fixed = fixed_choices(cfg)
    shape = model_shape(cfg)
    estimates = [evaluate(cfg, shape, layout, cluster, headroom)
                 for layout in candidate_layouts(cfg, cluster.devices, space)
                 if all(getattr(layout, k) == v for k, v in fixed.items())]
    return sorted(estimates, key=lambda e: (not e.fits, e.time.total if e.fits else e.memory.total,
                                            e.memory.total))
