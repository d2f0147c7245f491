"""Throughput of tensor parallelism against data parallelism and one process, on the same model.

    python benchmarks/tp_throughput.py                   # ~5-8 min on a quiet 2-core CPU
    python benchmarks/tp_throughput.py --rounds 1 --steps 2 --warmup 1   # a check that it runs
    python benchmarks/tp_throughput.py --json tp_tput.json

Layouts, all at the same global batch (so the same tokens per step and the same loss):
1 process with `--threads` threads, and with 1 thread; dp = 2; tp = 2; tp = 2 with sequence
parallelism. The multi-process layouts split `--threads` between their ranks (gloo,
tests/multirank.py). The one-thread process is the baseline that does not depend on how
well intra-op threads scale (they scale badly on a machine busy with other work).
Each layout builds `Trainer(cfg)`, runs `--warmup` untimed steps, then `--steps` timed
`train_step()`s between barriers; the layouts take turns over `--rounds` rounds (the
order rotates each round) so drift in machine speed hits all of them. tokens/s = global
batch x seq len x steps / wall time; the table gives the median over rounds and the ratio
to one process.

On a CPU the ranks share the same cores, so what is measured is each layout's overhead
at a fixed amount of compute: 1.0 is the ceiling for any two-rank layout here. On GPUs,
where each rank brings its own device, the ideal is 2.0 for both dp = 2 and tp = 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests is not installed
from tests.multirank import run_ranks

LAYOUTS = {  # name -> (ranks, threads per rank (0 = share --threads), overrides)
    "1 process": (1, 0, []),
    "1 process, 1 thread": (1, 1, []),
    "dp = 2": (2, 0, []),
    "tp = 2": (2, 0, ["--parallel.tp", "2"]),
    "tp = 2, SP": (2, 0, ["--parallel.tp", "2", "--parallel.sp", "true"]),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="model size preset")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--source", default="stdlib", help="data.source (the first stdlib call tokenizes, ~30 s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per layout and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads shared by a layout's ranks")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def _time_layout(rank: int, world_size: int, overrides: list[str], args, threads: int) -> dict:
    import torch.distributed as dist

    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    torch.set_num_threads(threads)
    trainer = Trainer(load_config(None, overrides))
    for _ in range(args.warmup):
        trainer.train_step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        stats = trainer.train_step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    trainer.close()
    tokens = args.global_batch * args.seq_len * args.steps
    return {"tokens_per_s": tokens / elapsed, "loss": stats["loss"], "params": trainer.model.num_params()}


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f}; measure on a quiet machine", file=sys.stderr)
    common = ["--model.size", args.size, "--data.source", args.source, "--data.seq_len", str(args.seq_len),
              "--train.micro_batch_size", str(args.micro_batch), "--train.global_batch_size", str(args.global_batch),
              "--run.sample_tokens", "0", "--checkpoint.resume", "none"]
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                ranks, threads, extra = LAYOUTS[name]
                overrides = common + ["--run.out_dir", f"{tmp}/{round_}-{len(runs[name])}-{ranks}"] + extra
                threads = threads or max(1, args.threads // ranks)
                result = run_ranks(ranks, _time_layout, overrides, args, threads)[0]
                runs[name].append(result)
                print(f"round {round_ + 1}: {name}: {result['tokens_per_s']:,.0f} tok/s "
                      f"(loss {result['loss']:.4f})", flush=True)
    medians = {name: statistics.median(r["tokens_per_s"] for r in rows) for name, rows in runs.items()}
    params = runs[names[0]][0]["params"]
    print(f"\n{datetime.date.today()}, cpu: {os.cpu_count()} cores, {args.threads} threads per layout, torch "
          f"{torch.__version__}, load average {load:.1f} at start. llama {args.size} ({params / 1e6:.1f}M "
          f"parameters), seq {args.seq_len}, micro-batch {args.micro_batch}, global batch {args.global_batch}, "
          f"fp32; {args.rounds} rounds x {args.steps} timed steps after {args.warmup} warm-up steps.\n")
    print("| layout | tokens/s (median) | x of 1 process | x of 1 process, 1 thread | loss after the last step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in names:
        print(f"| {name} | {medians[name]:,.0f} | {medians[name] / medians[names[0]]:.2f} | "
              f"{medians[name] / medians[names[1]]:.2f} | {runs[name][-1]['loss']:.4f} |")
    print(f"\nCommand: python benchmarks/tp_throughput.py {' '.join(sys.argv[1:])}".rstrip())
    if args.json:
        args.json.write_text(json.dumps({"medians": medians, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
