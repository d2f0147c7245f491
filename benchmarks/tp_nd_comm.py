"""1D against 2D / 2.5D / 3D tensor parallelism: bytes, peers and memory per rank per step, with theory.

    python benchmarks/tp_nd_comm.py                  # ~5 min on 2 cores: tp 8 (1d, 2.5d, 3d), tp 4 (1d, 2d)
    python benchmarks/tp_nd_comm.py --n-layers 1     # quicker
    python benchmarks/tp_nd_comm.py --json nd.json   # also writes every figure as JSON

tp = 8 is not a square, so 2d is measured at tp = 4 beside 1d at tp = 4. For each
layout one set of gloo ranks (tests/multirank.py) builds `Trainer(cfg)` on the same
model and batch (dp = 1, one micro-batch per step), runs a warm-up `train_step()` and
measures the second:

- bytes sent: polytrain's tally (`collectives.comm_stats()`, every tensor-parallel
  collective as a ring algorithm moves it) and, independently, every torch.distributed
  call of the step (zero_memory_comm.CommCounter; this also sees the gradient-norm and
  loss-average all-reduces, a few bytes);
- peers: the distinct ranks this rank's collectives exchanged data with;
- parameter bytes this rank holds, and activation bytes: what autograd saved for
  backward during the step (distinct storages, parameters excluded), the memory that
  grows with the batch.

Analytic figures (fp32, e = 4 bytes, N = B T tokens per micro-batch, width D, FFN F,
KV width K, vocabulary V, L blocks, f_n = (n-1)/n) come from counting each scheme's
collectives (`analytic`): per linear layer in -> out,

    1d    2 f e N D (4L + 2) + 2 f e 3N                  (Megatron; tp_comm.analytic_bytes)
    2d    2 f_q e (N_r in + out in / q)                   N_r = N / (dq) tokens per rank; the input
                                                          term once per region for wq/wk/wv and w1/w3;
                                                          2.5d adds 2 f_d e out in / q^2 (depth
                                                          all-reduce of dW)
    3d    2 f_q e (N (in + out) / q^2 + out in / q^2)

plus the embedding, norms (statistics forward and backward, gain gradients) and loss terms
spelled out in `analytic`. Peers: 1d tp - 1; 2d 2(q-1); 2.5d 2(q-1) + d - 1; 3d 3(q-1).
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
from benchmarks.tp_comm import analytic_bytes as analytic_1d
from benchmarks.zero_memory_comm import CommCounter
from tests.multirank import run_ranks

MiB = 2**20
# (tp, mode, depth): tp 8 in every mode that has a grid of 8, and 2d at 4 beside 1d.
LAYOUTS = {8: [("1d", 1), ("2.5d", 2), ("3d", 1)], 4: [("1d", 1), ("2d", 1)]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=8, help="query and KV heads (1d at tp 8 then splits them evenly)")
    p.add_argument("--ffn-dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8, help="divisible by 4: 3d and 2.5d at tp 8 split it 4 ways")
    p.add_argument("--source", default="stdlib", help="data.source (the first stdlib call tokenizes, ~30 s)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return p.parse_args()


def analytic(cfg, mode: str, tp: int, depth: int, e: int = 4) -> dict[str, float]:
    """Bytes one rank sends per micro-batch, parameter bytes and peers, for `mode` at `tp`."""
    m = cfg.model
    N, D, F, V, L = cfg.train.micro_batch_size * cfg.data.seq_len, m.dim, m.ffn_dim, m.vocab_size, m.n_layers
    K = m.n_kv_heads * (D // m.n_heads)
    linears = [(D, D), (D, K), (D, K), (D, D), (D, F), (D, F), (F, D)] * L + [(D, V)]  # (in, out), head last
    weights = sum(i * o for i, o in linears) + V * D  # matmul weights and the embedding
    norms = (2 * L + 1) * D
    if mode == "1d":
        return {"bytes": sum(analytic_1d(cfg, tp, False, 1, e).values()), "peers": tp - 1,
                "param_bytes": e * (weights / tp + norms)}
    if mode == "3d":
        q = round(tp ** (1 / 3))
        f = (q - 1) / q
        sent = sum(2 * f * e * (N * (i + o) + i * o) / q**2 for i, o in linears)
        sent += 2 * f * e * N * D / q * (1 + 1 / q)  # embedding: reduce-scatters along i then j, and back
        sent += (2 * L + 1) * (4 * f * e * N / q**2 + 2 * 2 * f * e * D / q)  # norm stats; gains along i, j
        sent += 2 * f * e * 3 * N / q**2 + 2 * 2 * f * e  # loss: per token (max, sum exp, target); scalar
        return {"bytes": sent, "peers": 3 * (q - 1), "param_bytes": e * (weights / q**3 + norms / q)}
    q = round((tp // depth) ** 0.5)
    f, fd, n = (q - 1) / q, (depth - 1) / depth, N / (depth * q)
    gathered = [D, D, D, F] * L + [D]  # inputs gathered along the row: regions (attention, MLP), wo, w2, head
    sent = sum(2 * f * e * n * i for i in gathered)
    sent += sum(2 * f * e * o * i / q + 2 * fd * e * o * i / q**2 for i, o in linears)  # W along i; dW along k
    sent += 2 * f * e * N / depth * D / q + 2 * fd * e * V * D / q**2  # embedding; its depth all-reduce
    sent += (2 * L + 1) * (4 * f * e * n + 2 * (f + fd) * e * D / q)  # norm stats; gains along i, k
    sent += 2 * f * e * 3 * n + 2 * (f + fd) * e  # loss
    return {"bytes": sent, "peers": 2 * (q - 1) + depth - 1, "param_bytes": e * (weights + norms * q) / q**2}


def _overrides(args, run_dir: str, tp: int, mode: str, depth: int) -> list[str]:
    values = {
        "model.dim": args.dim, "model.n_layers": args.n_layers, "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.n_heads, "model.ffn_dim": args.ffn_dim, "model.vocab_size": args.vocab,
        "data.source": args.source, "data.seq_len": args.seq_len, "train.micro_batch_size": args.micro_batch,
        "train.global_batch_size": args.micro_batch, "parallel.tp": tp, "parallel.tp_mode": mode,
        "parallel.tp_depth": depth, "run.out_dir": run_dir, "run.sample_tokens": 0, "checkpoint.resume": "none",
    }
    return [item for k, v in values.items() for item in (f"--{k}", str(v).lower())]


class SavedActivations:
    """Bytes of the distinct non-parameter storages autograd saves for backward within `with`."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.to_local().untyped_storage().data_ptr() if hasattr(p, "to_local")
                       else p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _measure(rank: int, world_size: int, args, run_root: str) -> list[dict]:
    from polytrain.config import load_config
    from polytrain.distributed.collectives import comm_stats
    from polytrain.train.trainer import Trainer

    rows = []
    for mode, depth in LAYOUTS[world_size]:
        cfg = load_config(None, _overrides(args, f"{run_root}/{mode}", world_size, mode, depth))
        trainer = Trainer(cfg)
        trainer.train_step()  # warm-up: the optimizer state is created here
        saved = SavedActivations(trainer.model)
        with CommCounter() as c10d, comm_stats() as stats, \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            trainer.train_step()
        trainer.close()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.model.parameters()]
        rows.append({
            "tp": world_size, "mode": mode, "depth": depth, "rank": rank, "kinds": stats.as_dict(),
            "bytes": stats.total_bytes, "c10d_bytes": c10d.total("model") + c10d.total("small"),
            "peers": len(stats.peers), "param_bytes": sum(t.numel() * t.element_size() for t in local),
            "activation_bytes": saved.bytes, "analytic": analytic(cfg, mode, world_size, depth),
            "params": sum(p.numel() for p in trainer.model.parameters()),
        })
    return rows


def main() -> None:
    args = parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in LAYOUTS:
            per_rank = run_ranks(tp, _measure, args, tmp)
            for rows in zip(*per_rank):
                # Every rank of a layout sends the same amount (the schemes are symmetric).
                spread = {round(r["bytes"]) for r in rows}
                assert len(spread) == 1, f"{rows[0]['mode']}: ranks sent different amounts: {spread}"
                results.append(rows[0])
    print(f"\n{datetime.date.today()}, cpu gloo, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}. llama dim "
          f"{args.dim}, {args.n_layers} blocks, {args.n_heads} heads (= KV heads), FFN {args.ffn_dim}, vocab "
          f"{args.vocab} ({results[0]['params'] / 1e6:.2f}M parameters), micro-batch {args.micro_batch} x seq "
          f"{args.seq_len}, one micro-batch per step, fp32, dp = 1. 2d has no grid of 8 ranks (8 is not a "
          f"square): it is measured at tp = 4.\n")
    print("| tp | mode | grid | MiB sent/rank/step | analytic | ratio | all c10d MiB | peers (analytic) "
          "| param MiB/rank (analytic) | saved activations MiB/rank |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        a, tp = r["analytic"], r["tp"]
        grid = {"1d": f"{tp}", "2d": "2 x 2", "2.5d": "2 x 2 x 2 (d = 2)", "3d": "2 x 2 x 2"}[r["mode"]]
        print(f"| {tp} | {r['mode']} | {grid} | {r['bytes'] / MiB:.3f} | {a['bytes'] / MiB:.3f} | "
              f"{r['bytes'] / a['bytes']:.3f} | {r['c10d_bytes'] / MiB:.3f} | {r['peers']} ({a['peers']}) | "
              f"{r['param_bytes'] / MiB:.3f} ({a['param_bytes'] / MiB:.3f}) | {r['activation_bytes'] / MiB:.3f} |")
    print(f"\nCommand: python benchmarks/tp_nd_comm.py {' '.join(sys.argv[1:])}".rstrip())
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
