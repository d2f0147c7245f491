"""One training worker: `python -m polytrain.train [--config FILE] [--deepspeed_config F] [--section.key VALUE ...]`.

Single process:      python -m polytrain.train --run.steps 100
Under torchrun:      torchrun --nnodes 2 --nproc_per_node 8 -m polytrain.train --config c.toml
Local workers:       polytrain train --parallel.nproc 4      (starts this module 4 times)
"""

from __future__ import annotations

import os
import sys
import warnings

from polytrain.config import Config, load_config
from polytrain.train.elastic import elastic_config
from polytrain.train.elastic_launch import ELASTIC_ENV
from polytrain.train.launch import LAUNCHED_ENV
from polytrain.train.worker_exit import run_and_exit, run_rank


def _take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `--name VALUE` (or `--name=VALUE`) from argv; returns (VALUE or None, the rest)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif argv[i].startswith(name + "="):
            value, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return value, rest


def config_from_argv(argv: list[str]) -> Config:
    """`[--config FILE.toml] [--deepspeed_config ds_config.json] [--section.key VALUE ...]` -> Config.

    Precedence: defaults < TOML < the DeepSpeed config < command-line overrides. The
    DeepSpeed batch rules need the data-parallel world size: WORLD_SIZE under torchrun,
    else parallel.nproc.
    """
    path, rest = _take_option(argv, "--config")
    ds_path, overrides = _take_option(rest, "--deepspeed_config")
    if ds_path is None:
        return load_config(path, overrides)
    from polytrain.deepspeed import load_ds_config, to_overrides

    world = int(os.environ.get("WORLD_SIZE") or load_config(path, overrides).parallel.nproc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load_ds_config(ds_path, world_size=world)
    # One line, once per job: by rank 0, and not again by workers `polytrain train` started.
    if os.environ.get("RANK", "0") == "0" and LAUNCHED_ENV not in os.environ:
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr, flush=True)
    return load_config(path, to_overrides(ds) + overrides)


def run_worker(argv: list[str], cfg: Config | None = None) -> int:
    """Train as one rank of the job the environment describes; returns an exit code.

    `cfg`, when the caller already parsed `argv`, saves parsing (and warning) twice.
    """
    from polytrain.train.trainer import Trainer, summary_lines

    def work() -> list[str]:
        config = cfg or config_from_argv(argv)
        if config.parallel.elastic or os.environ.get(ELASTIC_ENV) == "1":
            config = elastic_config(config, int(os.environ.get("WORLD_SIZE", "1")))
        return summary_lines(Trainer(config).train())

    return run_rank(work)


if __name__ == "__main__":
    run_and_exit(lambda: run_worker(sys.argv[1:]))
