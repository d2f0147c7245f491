"""One training worker: `python -m polytrain.train [--config FILE] [--section.key VALUE ...]`.

Single process:      python -m polytrain.train --run.steps 100
Under torchrun:      torchrun --nnodes 2 --nproc_per_node 8 -m polytrain.train --config c.toml
Local workers:       polytrain train --parallel.nproc 4      (starts this module 4 times)
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from polytrain.config import load_config
from polytrain.errors import PolytrainError
from polytrain.train.launch import EXIT_USER_ERROR


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take `--config FILE` (or `--config=FILE`) out of argv; the rest are overrides."""
    rest, path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return path, rest


def run_worker(argv: list[str]) -> int:
    """Train as one rank of the job the environment describes; returns an exit code."""
    from polytrain.train.trainer import Trainer, summary_lines

    rank = int(os.environ.get("RANK", "0"))
    # Rank 0 tells what it is doing (e.g. tokenizing the corpus once); the others stay quiet.
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        path, overrides = split_config_arg(argv)
        trainer = Trainer(load_config(path, overrides))
        summary = trainer.train()
    except PolytrainError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print("\n".join(summary_lines(summary)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:]))
