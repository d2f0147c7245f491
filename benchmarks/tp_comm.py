"""Tensor / sequence parallelism: bytes each rank sends per training step, against the analytic figure.

    python benchmarks/tp_comm.py                        # ~2-4 min on 2 cores: tp 2 and 4, SP off and on
    python benchmarks/tp_comm.py --tp 2 --n-layers 2    # ~1 min check that it runs
    python benchmarks/tp_comm.py --json tp_comm.json    # also writes every figure as JSON

For each tp, one set of gloo ranks (tests/multirank.py) builds `Trainer(cfg)` with
parallel.tp = tp (dp = 1) and SP off, then on, runs one warm-up `train_step()` and
measures the second, counting bytes two ways:

1. polytrain's own tally (`collectives.comm_stats()`): every tensor-parallel collective,
   by kind, as a ring algorithm moves it.
2. Independently, every torch.distributed call of the step, wrapped at the c10d level
   (zero_memory_comm.CommCounter); this also sees the gradient-norm and loss-average
   all-reduces, a few bytes, which are not tensor parallelism's.

The analytic figure (Korthikanti et al. 2022, per micro-batch of B x T tokens, width D,
L blocks, f = (tp-1)/tp, b = bytes per element) is `analytic_bytes`:

    activations  2f b BTD (4L + 2)     each block: 2 all-reduces (attention, MLP) forward and
                                       2 backward; plus the embedding's output (forward) and
                                       the head's input (backward). Under SP every all-reduce
                                       becomes an all-gather + reduce-scatter: the same bytes.
    loss         2f b 3BT              max, sum of exp and target logit per token
    SP norms     2f b D (2L + 1)       norm gains' gradients (partial per sequence shard)
    shared KV    2f b 2L Hkv hd D      tp > n_kv_heads only: replicated wk, wv gradients
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests / benchmarks are not installed
from benchmarks.zero_memory_comm import CommCounter
from tests.multirank import run_ranks

MiB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="model size preset")
    p.add_argument("--n-heads", type=int, default=8, help="query heads (small has 6, which tp 4 does not split)")
    p.add_argument("--n-layers", type=int, default=0, help="blocks (0 = the preset's)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--source", default="stdlib", help="data.source (the first stdlib call tokenizes, ~30 s)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def analytic_bytes(cfg, tp: int, sp: bool, micro_batches: int, elem: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step in 1D tensor (and sequence) parallelism, by term."""
    m, f = cfg.model, (tp - 1) / tp
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    layers, head_dim = m.n_layers, m.dim // m.n_heads
    terms = {
        "activations": 2 * f * elem * tokens * m.dim * (4 * layers + 2),
        "loss": 2 * f * elem * 3 * tokens,
        "norm gains": 2 * f * elem * m.dim * (2 * layers + 1) if sp else 0.0,
        "shared KV": 2 * f * elem * 2 * layers * m.n_kv_heads * head_dim * m.dim if tp > m.n_kv_heads else 0.0,
    }
    return {k: v * micro_batches for k, v in terms.items()}


def _overrides(args, run_dir: str, tp: int, sp: bool) -> list[str]:
    values = {
        "model.size": args.size, "model.n_heads": args.n_heads, "data.source": args.source,
        "data.seq_len": args.seq_len, "train.micro_batch_size": args.micro_batch,
        "train.global_batch_size": args.micro_batch * args.accum, "parallel.tp": tp, "parallel.sp": sp,
        "run.out_dir": run_dir, "run.sample_tokens": 0, "checkpoint.resume": "none",
    }
    if args.n_layers:
        values["model.n_layers"] = args.n_layers
    return [item for k, v in values.items() for item in (f"--{k}", str(v).lower())]


def _measure(rank: int, world_size: int, args, run_root: str) -> list[dict]:
    from polytrain.config import load_config
    from polytrain.distributed.collectives import comm_stats
    from polytrain.train.trainer import Trainer

    rows = []
    for sp in (False, True):
        cfg = load_config(None, _overrides(args, f"{run_root}/sp{int(sp)}", world_size, sp))
        trainer = Trainer(cfg)
        trainer.train_step()  # warm-up: the optimizer state is created here
        with CommCounter() as c10d, comm_stats() as stats:
            trainer.train_step()
        trainer.close()
        theory = analytic_bytes(cfg, world_size, sp, trainer.accum)
        rows.append({
            "tp": world_size, "sp": sp, "rank": rank, "kinds": stats.as_dict(),
            "polytrain_bytes": stats.total_bytes, "c10d_bytes": c10d.total("model") + c10d.total("small"),
            "analytic": theory, "analytic_bytes": sum(theory.values()),
            "params": trainer.model.num_params(), "cfg": {"dim": cfg.model.dim, "n_layers": cfg.model.n_layers,
                                                          "n_heads": cfg.model.n_heads, "n_kv_heads": cfg.model.n_kv_heads,
                                                          "vocab": cfg.model.vocab_size},
        })
    return rows


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f}; byte counts do not depend on it, timings would", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            per_rank = run_ranks(tp, _measure, args, tmp)
            # Every rank of a tp group sends the same amount; report rank 0 and check the rest.
            for rows in zip(*per_rank):
                spread = {round(r["polytrain_bytes"]) for r in rows}
                assert len(spread) == 1, f"ranks sent different amounts: {spread}"
                results.append(rows[0])
    first = results[0]
    c = first["cfg"]
    print(f"\n{datetime.date.today()}, cpu gloo, torch {torch.__version__}. llama {args.size} with "
          f"n_heads {c['n_heads']} (dim {c['dim']}, {c['n_layers']} blocks, {c['n_kv_heads']} KV heads, "
          f"vocab {c['vocab']}; {first['params'] / 1e6:.1f}M parameters), seq {args.seq_len}, micro-batch "
          f"{args.micro_batch}, {args.accum} micro-batches per step, fp32, dp = 1.\n")
    print("| tp | SP | collectives per step (calls) | polytrain count MiB/step | all c10d traffic MiB/step "
          "| analytic MiB/step | ratio |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        kinds = ", ".join(f"{k} {v['calls']}" for k, v in r["kinds"].items())
        print(f"| {r['tp']} | {'on' if r['sp'] else 'off'} | {kinds} | {r['polytrain_bytes'] / MiB:.3f} | "
              f"{r['c10d_bytes'] / MiB:.3f} | {r['analytic_bytes'] / MiB:.3f} | "
              f"{r['polytrain_bytes'] / r['analytic_bytes']:.3f} |")
    print("\nAnalytic terms (MiB/step): " + "; ".join(
        f"tp {r['tp']} SP {'on' if r['sp'] else 'off'}: " + ", ".join(
            f"{k} {v / MiB:.3f}" for k, v in r["analytic"].items() if v) for r in results))
    print(f"\nCommand: python benchmarks/tp_comm.py {' '.join(sys.argv[1:])}".rstrip())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
