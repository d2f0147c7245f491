"""Layouts for every world size an elastic job may run at, planned before it starts.

    layouts = elastic_layouts(cfg, 2, 4, cluster)   # {2: {"parallel.tp": ...}, 3: {...}, 4: {...}}
    write_layouts(cfg, layouts)                     # <run dir>/elastic_layouts.json, read by the workers

At each size the user's degrees are kept where they still divide the world and keep the
global batch (train/elastic.py's `with_degrees`, micro-batch re-derived); elsewhere the
planner's fastest layout that fits is taken, its micro-batch at most the configured one.
A size at which neither keeps the global batch is refused, naming the sizes that do and the
global batches every size in the range would keep with the user's degrees.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from polytrain.config import Config, TrainConfig
from polytrain.errors import ConfigError
from polytrain.plan.devices import Cluster
from polytrain.plan.layouts import SearchSpace, apply_layout
from polytrain.plan.planner import plan
from polytrain.train.elastic import LAYOUTS_FILE, fixed_degree, with_degrees

FREED = frozenset({"parallel.tp", "parallel.tp_mode", "parallel.sp", "parallel.pp", "parallel.dp",
                   "train.micro_batch_size", "parallel.nproc"})
LAYOUT_KEYS = ("parallel.nproc", "parallel.dp", "parallel.zero", "parallel.tp", "parallel.tp_mode",
               "parallel.tp_depth", "parallel.sp", "parallel.pp", "parallel.pp_schedule",
               "parallel.pp_virtual_stages", "train.micro_batch_size", "train.activation_checkpoint",
               "parallel.offload")


def _keys(cfg: Config) -> dict[str, object]:
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in LAYOUT_KEYS}


def layout_for_world(cfg: Config, world: int, cluster: Cluster) -> Config | None:
    """The config at `world` ranks: the user's degrees if they keep the batch, else the planner's; None if neither."""
    kept = with_degrees(cfg, world)
    if kept is not None:
        return kept
    free = dataclasses.replace(
        cfg, set_keys=cfg.set_keys - FREED,  # the degrees did not fit this world: the planner picks them
        parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, tp_mode="1d", sp=False, dp=-1, zero_shard=-1),
        train=dataclasses.replace(cfg.train, micro_batch_size=TrainConfig().micro_batch_size))
    space = SearchSpace(max_micro_batch=cfg.train.micro_batch_size, offload=("none",))
    nodes = cluster.nodes if world % cluster.nodes == 0 else 1
    best = next((e for e in plan(free, dataclasses.replace(cluster, devices=world, nodes=nodes), space)
                 if e.fits), None)
    return apply_layout(cfg, best.layout) if best is not None else None


def elastic_layouts(cfg: Config, low: int, high: int, cluster: Cluster) -> dict[int, dict[str, object]]:
    """World size -> the layout keys it runs with, for every size in [low, high]; ConfigError if one has none."""
    if not 1 <= low <= high:
        raise ConfigError(f"parallel.nproc = {low}:{high}: the fewest workers must be at least 1 and at most "
                          f"the most")
    layouts, missing = {}, []
    for world in range(low, high + 1):
        at = layout_for_world(cfg, world, cluster)
        if at is None:
            missing.append(world)
        else:
            layouts[world] = _keys(at)
    if missing:
        raise ConfigError(_refusal(cfg, low, high, missing, cluster))
    return layouts


def _refusal(cfg: Config, low: int, high: int, missing: list[int], cluster: Cluster) -> str:
    g, fixed = cfg.train.global_batch_size, fixed_degree(cfg)
    inside = [w for w in range(low, high + 1) if w not in missing]
    outside = [w for w in range(1, 2 * high + 1) if not low <= w <= high and with_degrees(cfg, w) is not None]
    keep = sorted(inside + outside)
    text = (f"train.global_batch_size = {g} cannot stay the same at {', '.join(map(str, missing))} worker(s) of "
            f"parallel.nproc = {low}:{high}; world sizes that keep it: {', '.join(map(str, keep)) or 'none'}")
    if all(w % fixed == 0 for w in range(low, high + 1)):
        unit = math.lcm(*(w // fixed for w in range(low, high + 1)))
        batches = sorted({max(unit, g // unit * unit), (g // unit + 1) * unit})
        text += (f"; global batches every size {low}..{high} keeps: {' or '.join(map(str, batches))} "
                 f"(multiples of {unit})")
    return text


def write_layouts(cfg: Config, layouts: dict[int, dict[str, object]]) -> Path:
    """Write <run dir>/elastic_layouts.json, which the job's workers read (train/elastic.py)."""
    path = cfg.run_dir / LAYOUTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({str(w): keys for w, keys in layouts.items()}, indent=1))
    tmp.replace(path)
    return path
