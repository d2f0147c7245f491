"""Candidate layouts for a world of N devices, and which of them start-up accepts.

A Layout is a set of config values (parallel.* degrees, micro-batch, recomputation,
offload) that keeps the config's global batch. `candidate_layouts` enumerates every
combination whose degrees multiply to the world size and whose micro-batch and
accumulation give the global batch, then keeps those the project's own start-up check
accepts (train/startup.plan_layout: the degree arithmetic, the tensor-parallel and pipeline
checks, the batch plan): what the planner proposes, `polytrain train` will run.

Context parallelism (parallel.cp / cp_mode, ring and Ulysses) is modelled from its
formulas; it is proposed when the config sets parallel.cp or `allow_cp` asks for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from polytrain.config import Config
from polytrain.distributed.pipeline.plan import MULTI_STAGE_SCHEDULES
from polytrain.distributed.tensor_parallel.checks import valid_tp_degrees
from polytrain.distributed.grid_shape import grid_side
from polytrain.errors import ConfigError
from polytrain.models import ARCHITECTURES
from polytrain.train.startup import plan_layout

CP_MODES = ("ulysses", "ring")


@dataclass(frozen=True)
class Layout:
    """One way to run the config on `world` ranks (see the module docstring)."""

    world: int
    dp: int
    zero: int = 0
    tp: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 2
    cp: int = 1
    cp_mode: str = "ring"
    micro_batch_size: int = 1
    accum: int = 1
    activation_checkpoint: str = "none"
    offload: str = "none"

    @property
    def stages_per_rank(self) -> int:
        return self.pp_virtual_stages if self.pp > 1 and self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

    def config_keys(self) -> dict[str, object]:
        """The config keys that select this layout (what `polytrain train --KEY VALUE` takes)."""
        keys: dict[str, object] = {
            "parallel.nproc": self.world, "parallel.dp": self.dp, "parallel.zero": self.zero,
            "parallel.tp": self.tp, "parallel.sp": self.sp, "parallel.pp": self.pp,
            "train.micro_batch_size": self.micro_batch_size,
            "train.activation_checkpoint": self.activation_checkpoint, "parallel.offload": self.offload,
        }
        if self.tp > 1 and self.tp_mode != "1d":
            keys["parallel.tp_mode"] = self.tp_mode
            if self.tp_mode == "2.5d":
                keys["parallel.tp_depth"] = self.tp_depth
        if self.pp > 1:
            keys["parallel.pp_schedule"] = self.pp_schedule
            if self.stages_per_rank > 1:
                keys["parallel.pp_virtual_stages"] = self.pp_virtual_stages
        if self.cp > 1:
            keys.update({"parallel.cp": self.cp, "parallel.cp_mode": self.cp_mode})
        return keys

    def command(self) -> str:
        """The `polytrain train` overrides of this layout, on one line (keys at their defaults left out)."""
        defaults = {"parallel.dp": self.dp, "parallel.zero": 0, "parallel.tp": 1, "parallel.sp": False,
                    "parallel.pp": 1, "train.activation_checkpoint": "none", "parallel.offload": "none"}
        return " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in self.config_keys().items() if defaults.get(k, not v) != v)

    def describe(self) -> str:
        """Short human form: 'tp 2 (sp) x pp 4 1f1b x dp 8 ZeRO-3, mbs 2 x 4, recompute full'."""
        parts = []
        if self.tp > 1:
            parts.append(f"tp {self.tp}" + (f" {self.tp_mode}" if self.tp_mode != "1d" else "") +
                         (" (sp)" if self.sp else ""))
        if self.cp > 1:
            parts.append(f"cp {self.cp} {self.cp_mode}")
        if self.pp > 1:
            parts.append(f"pp {self.pp} {self.pp_schedule}")
        parts.append(f"dp {self.dp}" + (f" ZeRO-{self.zero}" if self.zero else ""))
        text = " x ".join(parts) + f", mbs {self.micro_batch_size} x {self.accum}"
        if self.activation_checkpoint != "none":
            text += f", recompute {self.activation_checkpoint}"
        if self.offload != "none":
            text += f", offload {self.offload}"
        return text


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def apply_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` with the layout's keys set; `cfg` is left alone."""
    parallel = dataclasses.replace(
        cfg.parallel, nproc=layout.world, dp=layout.dp, zero=layout.zero, tp=layout.tp, sp=layout.sp,
        pp=layout.pp, tp_mode=layout.tp_mode, tp_depth=layout.tp_depth, pp_schedule=layout.pp_schedule,
        pp_virtual_stages=layout.pp_virtual_stages, pp_microbatches=0, zero_shard=-1, offload=layout.offload,
        cp=layout.cp, cp_mode=layout.cp_mode)
    train = dataclasses.replace(cfg.train, micro_batch_size=layout.micro_batch_size,
                                activation_checkpoint=layout.activation_checkpoint)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def accepted(cfg: Config, layout: Layout) -> bool:
    """Whether start-up would accept `layout` for `cfg`."""
    try:
        plan_layout(apply_layout(cfg, layout), layout.world)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class SearchSpace:
    """What to enumerate; the defaults cover everything polytrain runs."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload: tuple[str, ...] = ("none", "cpu")
    tp_modes: tuple[str, ...] = ("1d", "2d", "2.5d", "3d")
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved", "zero_bubble")
    max_cp: int = 1
    max_micro_batch: int = 64


def candidate_layouts(cfg: Config, world: int, space: SearchSpace = SearchSpace()) -> Iterator[Layout]:
    """Every layout of `world` ranks start-up accepts for `cfg`, at its global batch."""
    gbs, m = cfg.train.global_batch_size, cfg.model
    arch = ARCHITECTURES[m.arch]
    tp_degrees = set(valid_tp_degrees(m, arch.tp_shares_kv_heads)) if arch.plan_module else {1}
    checked: dict[tuple, bool] = {}
    for tp in divisors(world):
        for tp_mode in (space.tp_modes if tp > 1 else ("1d",)):
            if tp_mode == "1d" and tp not in tp_degrees:
                continue
            depths = [d for d in divisors(tp) if d > 1] if tp_mode == "2.5d" else [1]
            for tp_depth in depths:
                if tp_mode != "1d" and grid_side(tp_mode, tp, tp_depth) is None:
                    continue
                for cp in divisors(world // tp):
                    if cp > space.max_cp:
                        break
                    for pp in divisors(world // (tp * cp)):
                        dp = world // (tp * cp * pp)
                        yield from _with_rest(cfg, space, checked, gbs, world, dp, tp, tp_mode, tp_depth, cp, pp)


def _with_rest(cfg, space, checked, gbs, world, dp, tp, tp_mode, tp_depth, cp, pp) -> Iterator[Layout]:
    """The ZeRO stages, schedules, micro-batches, recomputation and offload around fixed degrees."""
    for mbs in divisors(gbs):
        if mbs > space.max_micro_batch or gbs % (mbs * dp):
            continue
        accum = gbs // (mbs * dp)
        for zero in space.zero_stages:
            offloads = [o for o in space.offload if o == "none" or zero in (1, 2)]
            for schedule in (space.schedules if pp > 1 else ("1f1b",)):
                cp_modes = CP_MODES if cp > 1 else ("ring",)
                for cp_mode in cp_modes:
                    for sp in ((False, True) if tp > 1 and tp_mode == "1d" else (False,)):
                        base = Layout(world, dp, zero, tp, tp_mode, tp_depth, sp, pp, schedule, 2, cp, cp_mode,
                                      mbs, accum)
                        # Recomputation and offload do not change what start-up checks.
                        if base not in checked:
                            checked[base] = accepted(cfg, base)
                        if not checked[base]:
                            continue
                        for recompute in space.recompute:
                            for offload in offloads:
                                yield dataclasses.replace(base, activation_checkpoint=recompute, offload=offload)


def layout_from_config(cfg: Config, world: int) -> Layout:
    """The layout a config runs at `world` ranks (its degrees and batch plan as start-up resolves them)."""
    checked = plan_layout(cfg, world)
    p, t, dims = cfg.parallel, cfg.train, checked.dims
    return Layout(world=world, dp=dims.dp, zero=p.zero, tp=p.tp, tp_mode=p.tp_mode, tp_depth=p.tp_depth,
                  sp=p.sp, pp=p.pp, pp_schedule=p.pp_schedule, pp_virtual_stages=p.pp_virtual_stages,
                  cp=p.cp, cp_mode=p.cp_mode,
                  micro_batch_size=t.micro_batch_size, accum=checked.batch.accum_steps,
                  activation_checkpoint=t.activation_checkpoint, offload=p.offload)
