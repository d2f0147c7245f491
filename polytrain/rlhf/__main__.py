"""One `polytrain rlhf` worker: `python -m polytrain.rlhf [--config FILE] [--section.key VALUE ...]`.

Single process:      python -m polytrain.rlhf --run.name chat
Under torchrun:      torchrun --nproc_per_node 8 -m polytrain.rlhf --config c.toml
Local workers:       polytrain rlhf --parallel.nproc 4      (starts this module 4 times)
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from polytrain.config import Config
from polytrain.errors import PolytrainError
from polytrain.train.__main__ import config_from_argv
from polytrain.train.launch import EXIT_USER_ERROR
from polytrain.train.worker_exit import run_and_exit


def run_worker(argv: list[str], cfg: Config | None = None) -> int:
    """Run the RLHF steps as one rank of the job the environment describes; returns an exit code."""
    from polytrain.rlhf.run import run_rlhf, summary_lines

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        cfg = cfg or config_from_argv(argv)
        summaries = run_rlhf(cfg)
    except PolytrainError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print("\n".join(summary_lines(cfg, summaries)), flush=True)
    return 0


if __name__ == "__main__":
    run_and_exit(lambda: run_worker(sys.argv[1:]))
