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
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests is not installed
from benchmarks.paired_trainers import (add_round_arguments, alternate, compare, load_at_start, machine_line,
                                        progress_line, publish, ratios, spread)
from tests.multirank import run_ranks

LAYOUTS = {"tp = 2": ["--parallel.tp", "2"], "tp = 2 + SP": ["--parallel.tp", "2", "--parallel.sp", "true"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="gpt2")
    p.add_argument("--size", default="small")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    add_round_arguments(p, rounds=7)
    return p.parse_args()


def _body(rank: int, world: int, args: argparse.Namespace, layout: list[str], work: str) -> dict:
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    torch.set_num_threads(max(1, args.threads // world))
    trainers = {}
    for name, flag in (("off", "false"), ("on", "true")):
        overrides = ["--model.arch", args.arch, "--model.size", args.size, "--data.source", args.source,
                     "--data.seq_len", str(args.seq_len), "--model.max_seq_len", str(args.seq_len),
                     "--train.micro_batch_size", str(args.micro_batch),
                     "--train.global_batch_size", str(args.micro_batch),
                     "--run.steps", str(args.warmup + args.rounds * args.steps), "--run.out_dir",
                     str(Path(work) / name), "--run.eval_every", "0", "--run.sample_tokens", "0",
                     "--checkpoint.resume", "none", *layout, "--parallel.tp_overlap", flag]
        trainers[name] = Trainer(load_config(None, overrides))
        for _ in range(args.warmup):
            trainers[name].train_step()
    rates, losses = alternate(trainers, args.rounds, args.steps, args.micro_batch * args.seq_len)
    for trainer in trainers.values():
        trainer.close()
    return {"rates": rates, "losses": losses}


def main() -> None:
    args = parse_args()
    load = load_at_start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-overlap-") as tmp:
        for layout in args.layouts.split(","):
            result = run_ranks(2, _body, args, LAYOUTS[layout], str(Path(tmp) / layout.replace(" ", "")),
                               timeout=3600)[0]
            row = {"layout": layout, **result, **compare(result["rates"], "on", "off")}
            rows.append(row)
            print(progress_line(layout, row, "off", "on"), flush=True)
    publish(report(args, rows, load), args.json, args, rows)


def report(args: argparse.Namespace, rows: list[dict], load: float) -> str:
    lines = [machine_line(load),
             f"`python benchmarks/tp_overlap.py {' '.join(sys.argv[1:])}`: {args.arch} {args.size}, seq "
             f"{args.seq_len} x micro-batch {args.micro_batch}, fp32, {args.rounds} rounds x {args.steps} steps "
             f"after {args.warmup} warm-up, {args.threads} threads over the 2 ranks", "",
             "| layout | overlap off tok/s (spread) | overlap on tok/s (spread) | on/off | per-round ratios "
             "| loss off / on |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['layout']} | {spread(r['rates']['off'])} | {spread(r['rates']['on'])} "
                     f"| **{r['ratio']:.3f}** | {ratios(r['round_ratios'])} "
                     f"| {r['losses']['off']:.5f} / {r['losses']['on']:.5f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
