"""Start-up host memory of a ZeRO-3 model: peak RSS per rank against one rank's share of the weights.

    python benchmarks/startup_memory.py                        # llama 1b at 4 ranks, ~2-4 min on 2 cores
    python benchmarks/startup_memory.py --size 125m --nproc 2  # a quick check that it runs

Each gloo rank builds the model on the meta device, shards it with ZeRO-3 (FSDP2) and
materializes it as the trainer does (polytrain/distributed/materialize.py), twice, in
fresh processes each time:

- "sharded": today's path, each rank computing only its shard's rows of every parameter
  (shard_init.py);
- "whole": the path before it, each rank generating every parameter whole and keeping
  its slice (forced by making the sharded path decline every parameter).

Reported per rank: the peak resident set (VmHWM) over start-up above the RSS before the
model existed (torch, gloo), against one rank's share of the fp32 parameters,
4 psi / N bytes (what ZeRO-3 keeps; the optimizer state does not exist before the first
step), and the time materialize took. Both paths give bit-identical weights
(tests/unit/test_shard_init.py); this compares only their cost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.multirank is not installed
from tests.multirank import run_ranks

MiB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1b", help="llama size preset")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return p.parse_args()


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _start_up(rank: int, world_size: int, size: str, whole: bool) -> dict:
    import torch

    from polytrain.config import load_config
    from polytrain.distributed import materialize as module
    from polytrain.distributed.strategies import build_data_parallel
    from polytrain.distributed.shard_init import UnsupportedInit
    from polytrain.models import ARCHITECTURES
    from polytrain.train.startup import start

    if whole:
        def decline(*args, **kwargs):
            raise UnsupportedInit("benchmark: generate every parameter whole")

        module.init_local_shard = decline
    cfg = load_config(None, ["--model.size", size, "--parallel.zero", "3",
                             "--train.global_batch_size", str(8 * world_size)])
    runtime, _ = start(cfg)  # joins the job run_ranks set up
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux)
        f.write("5")
    before = _status_mib("VmRSS")
    with torch.device("meta"):
        model = ARCHITECTURES["llama"].build(cfg.model)
    psi = model.num_params()
    dp = build_data_parallel(runtime, cfg.parallel)
    model = dp.parallelize(model)
    start = time.perf_counter()
    module.materialize(model, torch.device("cpu"), cfg.run.seed)
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"rank": rank, "psi": psi, "local_params": local, "rss_before_mib": before,
            "peak_mib": _status_mib("VmHWM"), "seconds": seconds}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # freed tensors leave RSS
    results = {}
    for path in ("sharded", "whole"):
        print(f"{path}: {args.nproc} ranks ...", flush=True)
        results[path] = run_ranks(args.nproc, _start_up, args.size, path == "whole", timeout=3600)
    from polytrain.backend import get_accelerator

    psi = results["sharded"][0]["psi"]
    share = 4 * psi / args.nproc
    load = os.getloadavg()[0]
    lines = [
        f"Machine: {get_accelerator().describe()} | {args.nproc} gloo ranks | "
        f"{datetime.date.today().isoformat()} | load average {load:.1f}",
        f"Model: llama {args.size} (psi = {psi:,} parameters), ZeRO-3 over {args.nproc} ranks; one rank's "
        f"share of the fp32 weights 4 psi / N = {share / MiB:,.0f} MiB",
        f"Command: `python benchmarks/startup_memory.py {' '.join(sys.argv[1:])}`",
        "",
        "| materialize | rank | RSS before the model MiB | peak RSS MiB | peak - before MiB | / share | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for path, ranks in results.items():
        for r in ranks:
            extra = r["peak_mib"] - r["rss_before_mib"]
            lines.append(f"| {path} | {r['rank']} | {r['rss_before_mib']:,.0f} | {r['peak_mib']:,.0f} "
                         f"| {extra:,.0f} | {extra * MiB / share:.3f} | {r['seconds']:.1f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "table": table, "args": vars(args)}, indent=1,
                                        default=str) + "\n")


if __name__ == "__main__":
    main()
