"""Rank the layouts of a cluster: every accepted layout, its peak memory per rank and its step time.

    estimates = plan(cfg, Cluster(device_spec("H100"), devices=64, nodes=8))
    best = estimates[0]            # fits, fastest step
    best.layout.config_keys()      # {"parallel.tp": 8, "parallel.pp": 2, ...}

Layouts that fit (peak below the device's memory less `headroom`) come first, fastest
step first (ties: less memory); those that do not fit follow, smallest first. The
user's own choices are kept: any layout key the config file or the command line sets
(e.g. parallel.tp = 2, train.activation_checkpoint = full) fixes that key.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.config import Config
from polytrain.plan.devices import GiB, Cluster
from polytrain.plan.layouts import Layout, SearchSpace, candidate_layouts
from polytrain.plan.memory import MemoryEstimate, estimate_memory
from polytrain.plan.shapes import ModelShape, model_shape
from polytrain.plan.step_time import TimeEstimate, estimate_step_time

# Layout field -> the config key that sets it (the keys a user may fix).
FIXABLE = {"dp": "parallel.dp", "zero": "parallel.zero", "tp": "parallel.tp", "tp_mode": "parallel.tp_mode",
           "sp": "parallel.sp", "pp": "parallel.pp", "pp_schedule": "parallel.pp_schedule",
           "offload": "parallel.offload", "micro_batch_size": "train.micro_batch_size",
           "activation_checkpoint": "train.activation_checkpoint", "cp": "parallel.cp", "cp_mode": "parallel.cp_mode"}


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
    """Layout fields the user set (the config file or the overrides named them): kept as they are."""
    out = {}
    for name, key in FIXABLE.items():
        section, _, field_name = key.partition(".")
        if key in cfg.set_keys and hasattr(getattr(cfg, section), field_name):
            out[name] = getattr(getattr(cfg, section), field_name)
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
        space = SearchSpace(max_cp=cluster.devices if (allow_cp or cfg.parallel.cp > 1) else 1,
                            offload=("none", "cpu") if not cluster.device.cores_per_node else ("none",))
    fixed = fixed_choices(cfg)
    shape = model_shape(cfg)
    estimates = [evaluate(cfg, shape, layout, cluster, headroom)
                 for layout in candidate_layouts(cfg, cluster.devices, space)
                 if all(getattr(layout, k) == v for k, v in fixed.items())]
    return sorted(estimates, key=lambda e: (not e.fits, e.time.total if e.fits else e.memory.total,
                                            e.memory.total))
