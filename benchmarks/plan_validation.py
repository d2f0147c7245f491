"""`polytrain plan`'s estimates against measurements on this machine: peak memory per rank and step time.

    python benchmarks/plan_validation.py                  # all layouts (~15-25 min on 2 busy cores)
    python benchmarks/plan_validation.py --only 0 1 2     # a few of them
    python benchmarks/plan_validation.py --json plan.json # also every figure as JSON

For each layout (LAYOUTS: the small and 125m Llama presets over 1 or 2 gloo ranks, every
parallel feature at least once), fresh ranks build `Trainer(cfg)` and run two steps: a
warm-up (which creates the optimizer state), then one with the resident set's high-water
mark (VmHWM) reset before it, so its peak is that step's, and timed.

The ranks run with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_): every
larger allocation is mapped on its own and returned when freed, so the resident set
follows the live tensors (the CPU's counterpart of torch.cuda.max_memory_allocated)
instead of keeping freed heap pages. The measured context is the resident set after the
trainer is built less every tensor then alive (torch, gloo, Python, the data, tokenizer);
the peak less that context is compared with the planner's estimate (polytrain.plan.evaluate,
device 'cpu') without its runtime-context term, on the fullest rank.

Step times are compared by rank (Spearman's rho over the layouts): absolute seconds on a
shared 2-core machine say little, and need a quiet re-run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests / benchmarks are not installed
from tests.multirank import run_ranks

GiB, MiB = 2**30, 2**20
COMMON = {"data.seq_len": 256, "run.sample_tokens": 0, "checkpoint.resume": "none", "run.eval_every": 0,
          "train.warmup_steps": 1}
# (name, world, overrides): small = 16M parameters (6 heads, 2 KV heads), 125m = 125M.
LAYOUTS = [
    ("small 1 rank", 1, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 16}),
    ("small 1 rank, recompute full", 1, {"model.size": "small", "train.micro_batch_size": 8,
                                         "train.global_batch_size": 16, "train.activation_checkpoint": "full"}),
    ("small 1 rank, bf16", 1, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 8,
                               "train.precision": "bf16"}),
    ("small 1 rank, plain loss", 1, {"model.size": "small", "train.micro_batch_size": 8,
                                     "train.global_batch_size": 8, "train.chunked_loss": False}),
    ("small dp 2", 2, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 16}),
    ("small dp 2 ZeRO-1", 2, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 32,
                              "parallel.zero": 1}),
    ("small dp 2 ZeRO-2", 2, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 32,
                              "parallel.zero": 2}),
    ("small dp 2 ZeRO-3", 2, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 16,
                              "parallel.zero": 3}),
    ("small tp 2", 2, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 8,
                       "parallel.tp": 2}),
    ("small tp 2 sp", 2, {"model.size": "small", "train.micro_batch_size": 8, "train.global_batch_size": 8,
                          "parallel.tp": 2, "parallel.sp": True}),
    ("small pp 2 1f1b", 2, {"model.size": "small", "train.micro_batch_size": 4, "train.global_batch_size": 16,
                            "parallel.pp": 2}),
    ("small pp 2 gpipe", 2, {"model.size": "small", "train.micro_batch_size": 4, "train.global_batch_size": 16,
                             "parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    ("125m 1 rank", 1, {"model.size": "125m", "train.micro_batch_size": 4, "train.global_batch_size": 4}),
    ("125m dp 2 ZeRO-2", 2, {"model.size": "125m", "train.micro_batch_size": 2, "train.global_batch_size": 4,
                             "parallel.zero": 2}),
    ("125m dp 2 ZeRO-3", 2, {"model.size": "125m", "train.micro_batch_size": 4, "train.global_batch_size": 8,
                             "parallel.zero": 3}),
    ("125m tp 2 sp", 2, {"model.size": "125m", "train.micro_batch_size": 4, "train.global_batch_size": 4,
                         "parallel.tp": 2, "parallel.sp": True}),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", type=int, nargs="+", help="indices into LAYOUTS (default: all)")
    p.add_argument("--source", default="stdlib", help="data.source (the first stdlib call tokenizes)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def overrides(values: dict, run_dir: str, source: str) -> list[str]:
    merged = {**COMMON, **values, "run.out_dir": run_dir, "data.source": source}
    return [item for k, v in merged.items() for item in (f"--{k}", str(v).lower())]


def _tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process (DTensors: local pieces)."""
    import torch
    from torch.distributed.tensor import DTensor

    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _measure(rank: int, world_size: int, argv: list[str]) -> dict:
    from polytrain.backend.host_device import peak_rss_bytes, reset_peak_rss, rss_bytes
    from polytrain.config import load_config
    from polytrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, argv))
    gc.collect()
    tensors = _tensor_bytes()  # the weights, ZeRO's shard buffers, the RoPE tables
    context = rss_bytes() - tensors  # torch, gloo, Python, the data: all but the model
    trainer.train_step()  # warm-up: creates the optimizer state
    gc.collect()
    reset_peak_rss()
    start = time.perf_counter()
    trainer.train_step()
    step_s = time.perf_counter() - start
    rss_peak = peak_rss_bytes()
    trainer.close()
    return {"rank": rank, "context": context, "tensors_at_start": tensors, "rss_peak": rss_peak, "step_s": step_s}


def predict(argv: list[str], world: int, cpu) -> dict:
    from polytrain.config import load_config
    from polytrain.plan import Cluster, evaluate, model_shape
    from polytrain.plan.layouts import layout_from_config

    cfg = load_config(None, argv)
    est = evaluate(cfg, model_shape(cfg), layout_from_config(cfg, world), Cluster(cpu, world))
    context = est.memory.parts["runtime context"]
    return {"memory": est.memory.total, "model_memory": est.memory.total - context, "step_s": est.time.total,
            "parts": est.memory.parts, "phase": est.memory.phase, "time_parts": est.time.parts}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (no ties expected among float timings)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def main() -> None:
    args = parse_args()
    import torch

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by the spawned ranks
    chosen = [(i, LAYOUTS[i]) for i in (args.only if args.only is not None else range(len(LAYOUTS)))]
    load_start = os.getloadavg()[0]
    from polytrain.plan import device_spec

    cpu = device_spec("cpu")  # measured once: every layout's estimate uses the same peak
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, world, values) in chosen:
            argv = overrides(values, f"{tmp}/run{i}", args.source)
            guess = predict(argv, world, cpu)
            began = time.perf_counter()
            ranks = run_ranks(world, _measure, argv, timeout=1800)
            full = max(ranks, key=lambda r: r["rss_peak"] - r["context"])
            row = {"index": i, "name": name, "world": world, "predicted": guess, "ranks": ranks,
                   "measured": full["rss_peak"] - full["context"], "context": full["context"],
                   "step_s": max(r["step_s"] for r in ranks), "seconds": time.perf_counter() - began}
            rows.append(row)
            print(f"[{i}] {name}: predicted {guess['model_memory'] / MiB:.0f} MiB ({guess['phase']}), measured "
                  f"{row['measured'] / MiB:.0f} MiB over a context of {row['context'] / MiB:.0f} MiB; step "
                  f"{row['step_s']:.2f} s (predicted {guess['step_s']:.2f}); parts "
                  + ", ".join(f"{k} {v / MiB:.0f}" for k, v in guess["parts"].items()), flush=True)
    load_end = os.getloadavg()[0]
    print(f"\n{datetime.date.today()}, cpu: {_cpu()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo; "
          f"load average {load_start:.1f} at start, {load_end:.1f} at end.\n")
    print("| layout | ranks | predicted MiB | measured MiB | predicted / measured | context MiB | "
          "predicted step s | measured step s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        p = r["predicted"]["model_memory"]
        print(f"| {r['name']} | {r['world']} | {p / MiB:.0f} | {r['measured'] / MiB:.0f} | "
              f"{p / r['measured']:.2f} | {r['context'] / MiB:.0f} | {r['predicted']['step_s']:.3f} | "
              f"{r['step_s']:.3f} |")
    if len(rows) > 2:
        rho = spearman([r["predicted"]["step_s"] for r in rows], [r["step_s"] for r in rows])
        print(f"\nSpearman rank correlation of predicted vs measured step time over {len(rows)} layouts: {rho:.2f}")
    errors = [abs(r["predicted"]["model_memory"] / r["measured"] - 1) for r in rows]
    print(f"Within 15% of the measured peak: {sum(e <= 0.15 for e in errors)} of {len(rows)} layouts "
          f"(largest error {max(errors):.0%})")
    print(f"\nCommand: python benchmarks/plan_validation.py {' '.join(sys.argv[1:])}".rstrip())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


def _cpu() -> str:
    from polytrain.backend.flops import cpu_model

    return cpu_model()


if __name__ == "__main__":
    main()
