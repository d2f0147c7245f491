"""One `polytrain rlhf` worker: `python -m polytrain.rlhf [--config FILE] [--section.key VALUE ...]`.

Single process:      python -m polytrain.rlhf --run.name chat
Under torchrun:      torchrun --nproc_per_node 8 -m polytrain.rlhf --config c.toml
Local workers:       polytrain rlhf --parallel.nproc 4      (starts this module 4 times)
"""

from __future__ import annotations

import sys

from polytrain.config import Config
from polytrain.train.__main__ import config_from_argv
from polytrain.train.worker_exit import run_and_exit, run_rank


def run_worker(argv: list[str], cfg: Config | None = None) -> int:
    """Run the RLHF steps as one rank of the job the environment describes; returns an exit code."""
    from polytrain.rlhf.run import run_rlhf, summary_lines

    def work() -> list[str]:
        config = cfg or config_from_argv(argv)
        return summary_lines(config, run_rlhf(config))

    return run_rank(work)


if __name__ == "__main__":
    run_and_exit(lambda: run_worker(sys.argv[1:]))
