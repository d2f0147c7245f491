"""One AdamW step three ways: torch's per-tensor loop, foreach ops, the fused kernel.

    python benchmarks/optimizer_step.py                  # tiny and small, plain and FSDP2 shards: ~2 min, 2 cores
    python benchmarks/optimizer_step.py --sizes tiny --rounds 1 --steps 2   # a check that it runs

On a llama preset's parameters (random gradients, polytrain's weight-decay groups): plain
tensors in one process (`--threads` threads), and FSDP2 shards (DTensors, `fully_shard` per
block as polytrain's ZeRO-3 does) on 2 gloo ranks with `--threads / 2` each. Each way
steps --warmup times, then --rounds rounds (the order rotating) of --steps timed steps;
the table gives the median milliseconds per step, the spread over rounds and the ratio to
the per-tensor loop (torch's choice on a CPU). polytrain uses the fused kernel
(optim/builder.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests is not installed
from tests.multirank import run_ranks

WAYS = {"per-tensor loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return p.parse_args()


def _timings(model: torch.nn.Module, args: argparse.Namespace, barrier=lambda: None) -> dict[str, list[float]]:
    from polytrain.optim.builder import param_groups

    optimizers = {name: torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, **kw) for name, kw in WAYS.items()}
    for opt in optimizers.values():
        for _ in range(args.warmup):
            opt.step()
    names, times = list(WAYS), {name: [] for name in WAYS}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                optimizers[name].step()
            barrier()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    return times


def _model(size: str):
    from polytrain.config import load_config
    from polytrain.models import ARCHITECTURES

    return ARCHITECTURES["llama"].build(load_config(None, ["--model.size", size]).model)


def _sharded(rank: int, world: int, size: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(max(1, args.threads // world))
    model, mesh = _model(size), init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)), mesh, p.placements)
    return _timings(model, args, dist.barrier)


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    from polytrain.backend import get_accelerator

    rows = []
    for size in args.sizes.split(","):
        torch.set_num_threads(args.threads)
        model = _model(size)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        rows.append((size, "plain tensors, 1 process", _timings(model, args)))
        rows.append((size, "FSDP2 shards, 2 ranks", run_ranks(2, _sharded, size, args)[0]))
    print(f"\n{datetime.date.today()}, {get_accelerator().describe()}, {args.threads} threads, load average "
          f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at the end")
    print(f"`python benchmarks/optimizer_step.py {' '.join(sys.argv[1:])}`\n")
    print("| size | parameters | way | ms per step (median) | spread | x of the per-tensor loop |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for size, where, times in rows:
        base = statistics.median(times["per-tensor loop"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {size} | {where} | {name} | {med:.1f} | {min(ts):.1f}-{max(ts):.1f} | {base / med:.2f} |")


if __name__ == "__main__":
    main()
