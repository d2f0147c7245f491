"""The layout of an elastic job at whatever world size it restarts with, keeping the global batch.

    cfg_at_3 = layout_for_world(cfg, 3, cluster)     # the config this attempt runs
    check_worlds(cfg, 2, 4)                          # at start-up: every allowed size can keep the batch

The global batch G = micro-batch x accumulation x dp stays what the config says; what adapts
is the layout and the micro-batch:

1. the user's fixed degrees (parallel.tp, pp, cp, tp_mode as configured) when their
   product divides the world: dp is what is left, and the micro-batch is the largest one
   not above the configured `train.micro_batch_size` that makes G a whole number of
   micro-batches on every dp rank;
2. otherwise the planner's fastest layout that fits for that world (polytrain plan).

A world size at which no layout keeps G is refused at start-up (`check_worlds`), naming the
world sizes that keep it and global batches that every allowed world size keeps.
"""

from __future__ import annotations

import dataclasses
import math

from polytrain.config import Config
from polytrain.errors import ConfigError
from polytrain.plan.devices import Cluster
from polytrain.plan.layouts import divisors


def _fixed_degree(cfg: Config) -> int:
    """tp x pp x cp as configured."""
    p = cfg.parallel
    return p.tp * p.pp * getattr(p, "cp", 1)


def micro_batch_for(cfg: Config, dp: int) -> int | None:
    """The largest micro-batch <= train.micro_batch_size that splits the global batch over `dp` ranks."""
    g = cfg.train.global_batch_size
    if g % dp:
        return None
    per_rank = g // dp
    return max(d for d in divisors(per_rank) if d <= cfg.train.micro_batch_size)


def with_degrees(cfg: Config, world: int) -> Config | None:
    """`cfg` at `world` ranks with its own degrees and a re-derived micro-batch, or None if they cannot
    keep the global batch there (or the world is not a multiple of tp x pp x cp)."""
    fixed = _fixed_degree(cfg)
    if world % fixed:
        return None
    dp = world // fixed
    mbs = micro_batch_for(cfg, dp)
    if mbs is None:
        return None
    from polytrain.distributed.topology import ParallelDims

    out = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc=world, dp=-1),
                              train=dataclasses.replace(cfg.train, micro_batch_size=mbs))
    try:
        ParallelDims.from_config(out, world)
    except ConfigError:
        return None
    return out


def layout_for_world(cfg: Config, world: int, cluster: Cluster | None = None) -> Config:
    """The config one attempt of an elastic job runs at `world` ranks (see the module docstring)."""
    kept = with_degrees(cfg, world)
    if kept is not None:
        return kept
    if cluster is not None:  # the degrees do not fit this world: the planner chooses
        from polytrain.config import TrainConfig
        from polytrain.plan.layouts import SearchSpace, apply_layout
        from polytrain.plan.planner import plan

        free = dataclasses.replace(
            cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, tp_mode="1d", sp=False, dp=-1, zero_shard=-1),
            train=dataclasses.replace(cfg.train, micro_batch_size=TrainConfig().micro_batch_size))
        space = SearchSpace(max_micro_batch=cfg.train.micro_batch_size, offload=("none",))
        nodes = cluster.nodes if world % cluster.nodes == 0 else 1
        estimates = plan(free, dataclasses.replace(cluster, devices=world, nodes=nodes), space)
        best = next((e for e in estimates if e.fits), None)
        if best is not None:
            return apply_layout(cfg, best.layout)
    raise ConfigError(f"no layout of {world} ranks keeps train.global_batch_size = "
                      f"{cfg.train.global_batch_size}: {_why(cfg, world)}")


def _why(cfg: Config, world: int) -> str:
    fixed = _fixed_degree(cfg)
    if world % fixed:
        return f"{world} is not a multiple of parallel.tp x pp = {fixed}"
    return f"it is not a multiple of dp = {world // fixed}"


def keeping_worlds(cfg: Config, low: int, high: int) -> list[int]:
    """World sizes in [low, high] at which the config's degrees keep its global batch."""
    return [w for w in range(low, high + 1) if with_degrees(cfg, w) is not None]


def check_worlds(cfg: Config, low: int, high: int) -> None:
    """Refuse an elastic range with a world size that cannot keep the global batch, saying which would."""
    if not 1 <= low <= high:
        raise ConfigError(f"parallel.nproc = {low}:{high}: the fewest workers must be at least 1 and "
                          f"at most the most")
    missing = [w for w in range(low, high + 1) if with_degrees(cfg, w) is None]
    if not missing:
        return
    fixed = _fixed_degree(cfg)
    keep = keeping_worlds(cfg, 1, max(high, 2 * high))
    dps = [w // fixed for w in range(low, high + 1) if w % fixed == 0]
    unit = math.lcm(*dps) if dps else 0
    g = cfg.train.global_batch_size
    batches = sorted({max(unit, g // unit * unit), (g // unit + 1) * unit}) if unit else []
    raise ConfigError(
        f"train.global_batch_size = {g} cannot stay the same at {', '.join(map(str, missing))} worker(s) of "
        f"parallel.nproc = {low}:{high}" + (f" (tp x pp = {fixed} must divide the world)" if fixed > 1 else "")
        + f"; world sizes that keep it: {', '.join(map(str, keep)) or 'none'}"
        + (f"; global batches every size {low}..{high} keeps: {' or '.join(map(str, batches))} "
           f"(multiples of {unit})" if batches and all(w % fixed == 0 for w in range(low, high + 1)) else ""))
