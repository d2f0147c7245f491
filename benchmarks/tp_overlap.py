"""Tensor parallelism with `parallel.tp_overlap` on against off: tp = 2, with and without SP.

    python benchmarks/tp_overlap.py                       # gpt2 small, seq 256 x 8 (vs_megatron's shape): ~5 min
    python benchmarks/tp_overlap.py --size tiny --rounds 1 --steps 1 --warmup 1   # a check that it runs
    python benchmarks/tp_overlap.py --json overlap.json

With overlap a region's entry starts the backward all-reduce (reduce-scatter under SP) of
its input gradient and computes its column layers' weight gradients while it runs
(polytrain/distributed/tensor_parallel/overlap.py); without, the reduction waits until
every column's backward is done. For each layout one pair of gloo ranks
(tests/multirank.py, one thread each by default) builds two `Trainer`s of the same config
but tp_overlap, runs `--warmup` untimed steps on each, then `--rounds` alternating rounds of
`--steps` timed `train_step()`s between barriers, who goes first swapping each round. The
table gives median tokens/s, the spread, per-round ratios and the losses after the last
step (equal: the two train the same thing from the same weights and samples).
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

LAYOUTS = {"tp = 2": ["--parallel.tp", "2"], "tp = 2 + SP": ["--parallel.tp", "2", "--parallel.sp", "true"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layout_arguments(p, LAYOUTS)
    add_round_arguments(p, rounds=7)
    return p.parse_args()


def _body(rank: int, world: int, args: argparse.Namespace, layout: list[str], work: str) -> dict:
    settings = {name: ["--parallel.tp_overlap", flag] for name, flag in (("off", "false"), ("on", "true"))}
    return train_pair(args, world, layout, Path(work), settings, args.micro_batch * args.seq_len, args.micro_batch)


def main() -> None:
    args = parse_args()
    rows, load = run_layouts(args, LAYOUTS, _body, "off", "on")
    publish_pairs(args, rows, load, "off", "on", ("overlap off", "overlap on"))


if __name__ == "__main__":
    main()
