"""ZeRO-2 with `parallel.reduce_bucket_auto` (measured bucket size) against the fixed 25 MiB, dp = 2.

    python benchmarks/bucket_size.py                      # llama small, shared memory and gloo: ~5 min
    python benchmarks/bucket_size.py --size tiny --rounds 1 --steps 1 --warmup 1   # a check that it runs
    python benchmarks/bucket_size.py --json buckets.json

With `reduce_bucket_auto` the ZeRO strategy times its gradient reduction on the dp group at
start, fits latency and bandwidth, and cuts the gradients into buckets of
sqrt(N x latency x bandwidth) bytes (polytrain/distributed/bucket_size.py); fixed, every
bucket holds up to `reduce_bucket_mb` (25 MiB). For each reduction path (the shared-memory
collectives, and gloo's with POLYTRAIN_SHM_ALL_REDUCE=0) one pair of gloo ranks
(tests/multirank.py) builds two `Trainer`s of the same config but the bucket sizing, runs
`--warmup` untimed steps on each, then `--rounds` alternating rounds of `--steps` timed
`train_step()`s between barriers, who goes first swapping each round. The table gives the
measured cost, the bucket count on each side, median tokens/s with the spread, per-round
ratios and the losses after the last step (equal but for the gradient norm's summation order).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests is not installed
from benchmarks.paired_trainers import (add_round_arguments, alternate, compare, load_at_start, machine_line,
                                        progress_line, publish, ratios, spread)
from polytrain.backend.host_collectives import ENV_SWITCH
from tests.multirank import run_ranks

PATHS = {"shared memory": "1", "gloo": "0"}  # name -> the ENV_SWITCH value


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="llama size preset")
    p.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ", ".join(PATHS))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    add_round_arguments(p, rounds=7)
    return p.parse_args()


def _body(rank: int, world: int, args: argparse.Namespace, switch: str, work: str) -> dict:
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    os.environ[ENV_SWITCH] = switch  # read at every collective
    torch.set_num_threads(max(1, args.threads // world))
    trainers = {}
    for name, flag in (("fixed", "false"), ("auto", "true")):
        overrides = ["--model.size", args.size, "--data.source", args.source, "--data.seq_len", str(args.seq_len),
                     "--train.micro_batch_size", str(args.micro_batch),
                     "--train.global_batch_size", str(args.global_batch), "--train.precision", args.precision,
                     "--run.steps", str(args.warmup + args.rounds * args.steps), "--run.out_dir",
                     str(Path(work) / name), "--run.eval_every", "0", "--run.sample_tokens", "0",
                     "--checkpoint.resume", "none", "--parallel.zero", "2", "--parallel.reduce_bucket_auto", flag]
        trainers[name] = Trainer(load_config(None, overrides))
        for _ in range(args.warmup):
            trainers[name].train_step()
    rates, losses = alternate(trainers, args.rounds, args.steps, args.global_batch * args.seq_len)
    choice = trainers["auto"].dp.bucket_choice
    buckets = {name: len(trainer.dp.buckets) for name, trainer in trainers.items()}
    for trainer in trainers.values():
        trainer.close()
    return {"rates": rates, "losses": losses, "buckets": buckets, "choice": choice.describe(),
            "latency_us": choice.cost.latency_s * 1e6, "gb_per_s": choice.cost.bytes_per_s / 1e9,
            "bucket_mib": choice.elements * 4 / 2**20}


def main() -> None:
    args = parse_args()
    load = load_at_start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-buckets-") as tmp:
        for path in args.paths.split(","):
            result = run_ranks(2, _body, args, PATHS[path], str(Path(tmp) / path.replace(" ", "")), timeout=3600)[0]
            row = {"path": path, **result, **compare(result["rates"], "auto", "fixed")}
            rows.append(row)
            print(progress_line(f"{path} ({result['choice']})", row, "fixed", "auto"), flush=True)
    publish(report(args, rows, load), args.json, args, rows)


def report(args: argparse.Namespace, rows: list[dict], load: float) -> str:
    lines = [machine_line(load),
             f"`python benchmarks/bucket_size.py {' '.join(sys.argv[1:])}`: llama {args.size}, ZeRO-2 over dp 2, "
             f"seq {args.seq_len}, micro-batch {args.micro_batch}, global batch {args.global_batch}, "
             f"{args.precision}, {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, "
             f"{args.threads} threads over the 2 ranks", "",
             "| reduction path | measured latency | measured bandwidth | auto bucket | buckets fixed / auto "
             "| fixed 25 MiB tok/s (spread) | auto tok/s (spread) | auto/fixed | per-round ratios "
             "| loss fixed / auto |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['latency_us']:.0f} us | {r['gb_per_s']:.2f} GB/s | {r['bucket_mib']:g} MiB "
                     f"| {r['buckets']['fixed']} / {r['buckets']['auto']} | {spread(r['rates']['fixed'])} "
                     f"| {spread(r['rates']['auto'])} | **{r['ratio']:.3f}** | {ratios(r['round_ratios'])} "
                     f"| {r['losses']['fixed']:.5f} / {r['losses']['auto']:.5f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
