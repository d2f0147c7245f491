"""The config an attempt of an elastic job runs at the world size it started with, the global batch kept.

    cfg = elastic_config(cfg, world)      # in every worker, before the trainer

The global batch G = micro-batch x accumulation x dp stays what the config says; what adapts:

1. a layout planned for this world size, if the launcher wrote one (<run dir>/elastic_layouts.json:
   `polytrain train --parallel.nproc MIN:MAX` plans one for every size in the range with
   `polytrain plan`'s estimates, and `polytrain plan --elastic MIN:MAX` writes the same file for
   torchrun jobs);
2. else the user's degrees (tp, pp, their modes) when they still divide the world: dp is what
   is left, and the micro-batch the largest one not above the configured
   `train.micro_batch_size` that makes G whole micro-batches on every dp rank;
3. else one line naming the problem and the fix.

Whatever is chosen passes the start-up check (startup.plan_layout) before it is returned.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from polytrain.config import Config
from polytrain.errors import ConfigError
from polytrain.train.startup import plan_layout

LAYOUTS_FILE = "elastic_layouts.json"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def micro_batch_for(cfg: Config, dp: int) -> int | None:
    """The largest micro-batch <= train.micro_batch_size that splits the global batch over `dp` ranks."""
    g = cfg.train.global_batch_size
    if g % dp:
        return None
    return max(d for d in _divisors(g // dp) if d <= cfg.train.micro_batch_size)


def fixed_degree(cfg: Config) -> int:
    """tp x pp (x cp, where the config has it) as configured."""
    p = cfg.parallel
    return p.tp * p.pp * getattr(p, "cp", 1)


def with_keys(cfg: Config, keys: dict[str, object]) -> Config:
    """A copy of `cfg` with `section.key` values replaced (the sections copied, `cfg` left alone)."""
    sections: dict[str, dict[str, object]] = {}
    for key, value in keys.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def with_degrees(cfg: Config, world: int) -> Config | None:
    """`cfg` at `world` ranks with its own degrees and a re-derived micro-batch, or None if they cannot
    keep the global batch there (or do not divide the world, or start-up refuses the result)."""
    fixed = fixed_degree(cfg)
    if world % fixed:
        return None
    mbs = micro_batch_for(cfg, world // fixed)
    if mbs is None:
        return None
    out = with_keys(cfg, {"parallel.nproc": world, "parallel.dp": -1, "train.micro_batch_size": mbs})
    try:
        plan_layout(out, world)
    except ConfigError:
        return None
    return out


def planned_layouts(run_dir: Path) -> dict[str, dict[str, object]]:
    """World size (as text) -> config keys, from the run directory's elastic_layouts.json (empty if none)."""
    path = Path(run_dir) / LAYOUTS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def elastic_config(cfg: Config, world: int) -> Config:
    """The config this attempt runs at `world` ranks (see the module docstring)."""
    planned = planned_layouts(cfg.run_dir).get(str(world))
    if planned is not None:
        out = with_keys(cfg, planned)
        plan_layout(out, world)  # a stale or hand-edited file still fails here, in one line
        return out
    kept = with_degrees(cfg, world)
    if kept is not None:
        return kept
    fixed = fixed_degree(cfg)
    why = (f"{world} is not a multiple of parallel.tp x pp = {fixed}" if world % fixed else
           f"it is not a multiple of dp = {world // fixed}")
    raise ConfigError(f"no layout of {world} ranks keeps train.global_batch_size = {cfg.train.global_batch_size} "
                      f"({why}); start the job with polytrain train --parallel.nproc MIN:MAX, or write a layout "
                      f"for every size with polytrain plan --elastic MIN:MAX")
