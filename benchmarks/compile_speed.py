"""The trainer with `train.compile` on against off, per model size and parallel layout.

    python benchmarks/compile_speed.py                  # tiny, small, 125m x dp 2, tp 2, ZeRO-3: ~25-40 min, 2 cores
    python benchmarks/compile_speed.py --sizes tiny --layouts "dp = 2" --rounds 1 --steps 1 --warmup 1
                                                        # a check that it runs
    python benchmarks/compile_speed.py --json compile.json

For each size and layout one set of gloo ranks (tests/multirank.py, the threads split
between them) builds two `Trainer`s of the same config, one with `train.compile = true`,
runs `--warmup` untimed steps on each (the compiled one's first step compiles; its time
is reported), then `--rounds` alternating rounds of `--steps` timed `train_step()`s
between barriers, who goes first swapping each round, so drift in machine speed hits
both. tokens/s = global batch x seq len x steps / wall time; the table gives medians,
the spread over rounds, the per-round ratios compiled / eager, and the losses after the
last step of each (equal within float rounding: they train the same thing from the same
weights and samples).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests is not installed
from benchmarks.paired_trainers import (add_round_arguments, alternate, compare, load_at_start, machine_line,
                                        progress_line, publish, ratios, spread)
from tests.multirank import run_ranks

LAYOUTS = {  # name -> (ranks, overrides)
    "1 process": (1, []),
    "dp = 2": (2, []),
    "tp = 2": (2, ["--parallel.tp", "2"]),
    "ZeRO-3": (2, ["--parallel.zero", "3"]),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,small,125m", help="llama size presets")
    p.add_argument("--layouts", default="dp = 2,tp = 2,ZeRO-3", help="comma list of " + ", ".join(LAYOUTS))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    add_round_arguments(p, rounds=5)
    return p.parse_args()


def _overrides(args, size: str, layout: list[str], out: Path) -> list[str]:
    return ["--model.size", size, "--data.source", args.source, "--data.seq_len", str(args.seq_len),
            "--train.micro_batch_size", str(args.micro_batch), "--train.global_batch_size", str(args.global_batch),
            "--run.steps", str(args.warmup + args.rounds * args.steps), "--run.out_dir", str(out),
            "--run.eval_every", "0", "--run.sample_tokens", "0", "--checkpoint.resume", "none", *layout]


def _body(rank: int, world: int, args: argparse.Namespace, size: str, layout: list[str], work: str) -> dict:
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    torch.set_num_threads(max(1, args.threads // world))
    trainers, warm = {}, {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        cfg = load_config(None, _overrides(args, size, layout, Path(work) / name) + ["--train.compile", flag])
        trainers[name] = Trainer(cfg)
        start = time.perf_counter()
        for _ in range(args.warmup):
            trainers[name].train_step()
        warm[name] = time.perf_counter() - start
    rates, losses = alternate(trainers, args.rounds, args.steps, args.global_batch * args.seq_len)
    timer = trainers["compiled"].compile_timer
    for trainer in trainers.values():
        trainer.close()
    return {"rates": rates, "warmup_s": warm, "losses": losses, "compile_s": timer.seconds,
            "graphs": timer.graphs, "breaks": timer.breaks}


def main() -> None:
    args = parse_args()
    load = load_at_start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-compile-") as tmp:
        for size in args.sizes.split(","):
            for layout in args.layouts.split(","):
                ranks, overrides = LAYOUTS[layout]
                work = Path(tmp) / f"{size}-{layout.replace(' ', '')}"
                result = run_ranks(ranks, _body, args, size, overrides, str(work), timeout=3600)[0]
                row = {"size": size, "layout": layout, **result, **compare(result["rates"], "compiled", "eager")}
                rows.append(row)
                print(progress_line(f"{size} {layout}", row, "eager", "compiled",
                                    f", compile {result['compile_s']:.0f} s", digits=4), flush=True)
    publish(report(args, rows, load), args.json, args, rows)


def report(args: argparse.Namespace, rows: list[dict], load: float) -> str:
    lines = [machine_line(load),
             f"`python benchmarks/compile_speed.py {' '.join(sys.argv[1:])}`: seq {args.seq_len}, "
             f"micro-batch {args.micro_batch}, global batch {args.global_batch}, fp32, {args.rounds} rounds x "
             f"{args.steps} steps after {args.warmup} warmup, {args.threads} threads per layout", "",
             "| size | layout | eager tok/s (spread) | compiled tok/s (spread) | compiled/eager | per-round ratios "
             "| compile s | graph breaks | loss eager / compiled |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['layout']} | {spread(r['rates']['eager'])} "
                     f"| {spread(r['rates']['compiled'])} | **{r['ratio']:.2f}** "
                     f"| {ratios(r['round_ratios'])} | {r['compile_s']:.0f} | {r['breaks']} "
                     f"| {r['losses']['eager']:.4f} / {r['losses']['compiled']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
