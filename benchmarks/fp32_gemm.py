"""fp32 training with its products on oneDNN against the BLAS (`train.fp32_gemm`), 2 ranks.

    python benchmarks/fp32_gemm.py                       # gpt2 small, seq 256 x 8: tp = 2 and ZeRO-2 over dp = 2, ~6 min
    python benchmarks/fp32_gemm.py --size tiny --rounds 1 --steps 1 --warmup 1   # a check that it runs

With `train.fp32_gemm = onednn` the Linear layers' and the chunked loss's forward and
input-gradient products run on oneDNN's matmul (backend/host_gemm.py: `onednn_linear`); with
`blas`, on torch's BLAS (MKL in x86 builds). For each layout one pair of gloo ranks
(tests/multirank.py, one thread each by default) builds two `Trainer`s of the same config but
that setting, runs `--warmup` untimed steps on each, then `--rounds` alternating rounds of
`--steps` timed `train_step()`s between barriers, who goes first swapping each round. The table
gives median tokens/s, the spread, per-round ratios and the losses after the last step (equal to
fp32 rounding: the two train the same thing from the same weights and samples).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests is not installed
from benchmarks.paired_trainers import (
    add_layout_arguments,
    add_round_arguments,
    publish_pairs,
    run_layouts,
    train_pair,
)

LAYOUTS = {"tp = 2": ["--parallel.tp", "2"], "ZeRO-2 dp = 2": ["--parallel.zero", "2"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layout_arguments(p, LAYOUTS)
    add_round_arguments(p, rounds=7)
    return p.parse_args()


def _body(rank: int, world: int, args: argparse.Namespace, layout: list[str], work: str) -> dict:
    replicas = 1 if "--parallel.tp" in layout else world  # data parallelism: a micro-batch a rank
    settings = {name: ["--train.fp32_gemm", name] for name in ("blas", "onednn")}
    return train_pair(args, world, layout, Path(work), settings, args.micro_batch * args.seq_len * replicas,
                      args.micro_batch * replicas)


def main() -> None:
    args = parse_args()
    rows, load = run_layouts(args, LAYOUTS, _body, "blas", "onednn")
    publish_pairs(args, rows, load, "blas", "onednn", ("BLAS", "oneDNN"))


if __name__ == "__main__":
    main()
